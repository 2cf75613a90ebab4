"""The offline tokenizer of the test models: a byte-level BPE trained in milliseconds on a small
inline corpus, with Qwen3.5's pre-tokenizer, control tokens and (simplified) chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")
SPECIAL_TOKENS += ("</think>", "<tool_call>", "</tool_call>")
# transformers' Qwen3_5Tokenizer split regex; transformers 5 rebuilds it for qwen3_5 folders.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_BPE_VOCAB = 352  # 256 byte symbols + ~96 merges, before the special tokens

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of tokens,
and the target model verifies the whole block in one forward pass. When the draft agrees with
the target, many tokens are accepted at once; otherwise the first mismatch is replaced by the
target's own token. Hello, world! How are you today? I am fine, thank you. What is the capital
of France? The capital of France is Paris. Let me think about this step by step.
The answer is 42. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.718.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"value {i} = {fibonacci(i)}")

class Server:
    def __init__(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.host = host
        self.port = port

    def run(self) -> None:
        return None

import json
data = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": true}
print(json.dumps(data, indent=2))
function add(a, b) { return a + b; }
const result = add(1, 2); console.log(result);
SELECT name, value FROM table WHERE id = 1 ORDER BY name;
The weather is nice today and the sun is shining over the hills.
"""

# Qwen3.5's render_content: a string as itself; a list of parts as its text parts, each image
# part as the vision markers (user messages and tool results alike).
_RENDER_CONTENT = (
    "{%- macro render_content(content) %}{%- if content is string %}{{- content }}"
    "{%- elif content is not none %}{%- for part in content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
)

_CHAT_TEMPLATE = _RENDER_CONTENT + (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format:"
    "\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
    "\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- if not (tools and loop.first) %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- if f.arguments is mapping %}{%- for k, v in f.arguments.items() %}"
    "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}{%- else %}{{- f.arguments ~ '\\n' }}{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def build_tokenizer(path: Path, special: Sequence[str] = SPECIAL_TOKENS) -> None:
    """Train a tiny byte-level BPE and write tokenizer.json + tokenizer_config.json to ``path``
    (``special``: the control tokens, appended after the BPE vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.add_special_tokens(list(special))  # appended after the BPE vocab, as in Qwen
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    flags = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False)
    added = {str(tok.token_to_id(t)): {"content": t, **flags, "special": True} for t in special}
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": _CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def tokenizer_size(path: Path) -> int:
    """Number of named token ids (BPE vocab plus special tokens) in ``path/tokenizer.json``."""
    data = json.loads((path / "tokenizer.json").read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
    return max(ids) + 1


def mask_token_id(path: Path) -> int:
    """A free embedding row past the named tokens, for the DFlash ``mask_token_id``.

    Like the real Qwen3.5 (mask 248070 right after ``</think>`` and friends), it is the first id
    the tokenizer never produces; ``build_target`` always leaves such rows in the embedding.
    """
    return tokenizer_size(path)
