// HTML for an assistant message: reasoning, answer, tool calls, notices and speculation stats.
// Everything from the server goes through escapeHtml or renderMarkdown (which escapes first).

import { escapeHtml, renderMarkdown } from "./markdown.js";

export function assistantHtml(msg) {
  return `<h2 class="visually-hidden">Assistant</h2>${reasoningHtml(msg)}` +
    `<div class="md content">${renderMarkdown(msg.content || "")}</div>` +
    toolCallsHtml(msg) + tokensHtml(msg) + noticeHtml(msg) + statsHtml(msg);
}

function reasoningHtml(msg) {
  if (!msg.reasoning) return "";
  // Open while the model is still thinking, collapsed once the answer starts; a user's own
  // choice (reasoningOpen) wins.
  const thinking = msg.streaming && !msg.content && !(msg.toolCalls || []).length;
  const open = msg.reasoningOpen ?? thinking;
  const label = thinking ? "Thinking…" : "Reasoning";
  return `<details class="reasoning"${open ? " open" : ""}><summary>${label}</summary>` +
    `<div class="md">${renderMarkdown(msg.reasoning)}</div></details>`;
}

function toolCallsHtml(msg) {
  const calls = (msg.toolCalls || []).filter(Boolean);
  if (!calls.length) return "";
  const items = calls.map((call) => {
    let args = call.arguments || "";
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch { /* still streaming, or not JSON: show as is */ }
    return `<li class="tool-call"><span class="tool-name">call: ${escapeHtml(call.name || "?")}</span>` +
      `<pre><code>${escapeHtml(args)}</code></pre></li>`;
  });
  return `<ul class="tool-calls" aria-label="Tool calls">${items.join("")}</ul>`;
}

// The `dflash_tokens` stream extension (requested with `dflash_tokens: true`): chunks carry
// `dflash_tokens: [{"text": "...", "source": "draft" | "suffix" | "target"}, ...]`, one entry per
// committed token, saying whether it was an accepted drafter token, an accepted copy from the
// context (suffix drafts) or the target's own. The tokens, tinted by source, are the answer
// again: they stay folded under a summary that is the colours' legend with each one's count.
const SOURCES = { draft: "accepted draft", suffix: "copied (suffix)", target: "target" };

function tokensHtml(msg) {
  if (!msg.tokens || !msg.tokens.length) return "";
  const counts = {};
  const spans = msg.tokens.map((t) => {
    const source = Object.hasOwn(SOURCES, t.source) ? t.source : "target";
    counts[source] = (counts[source] || 0) + 1;
    return `<span class="tok ${source}" title="${source}">${escapeHtml(t.text)}</span>`;
  });
  const legend = Object.entries(SOURCES).filter(([source]) => counts[source]).map(([source, name]) =>
    `<span class="key"><span class="swatch ${source}"></span>${name}: ${counts[source]}</span>`);
  return `<details class="tokens"${msg.tokensOpen ? " open" : ""}>` +
    `<summary>Tokens by source${legend.join("")}</summary>` +
    `<p class="tok-text">${spans.join("")}</p></details>`;
}

function noticeHtml(msg) {
  if (msg.error) {
    const { status, message, hint } = msg.error;
    const head = status ? `Error ${status}` : "Error";
    return `<div class="error" role="alert"><strong>${head}:</strong> ${escapeHtml(message)}` +
      (hint ? `<br>${escapeHtml(hint)}` : "") + "</div>";
  }
  if (msg.stopped) return `<p class="notice">Stopped.</p>`;
  if (msg.finish === "length") return `<p class="notice">Cut off at the token limit.</p>`;
  return "";
}

function statsHtml(msg) {
  const d = msg.dflash;
  const usage = msg.usage || {};
  const items = [];
  // A stopped answer gets no usage: count the tokens the stream brought (dflash_tokens).
  const tokens = usage.completion_tokens ?? msg.tokens?.length;
  if (tokens != null) items.push(["tokens", String(tokens)]);
  let tps = d && d.generation_tps;
  if (!tps && tokens && msg.elapsed && msg.ttft != null && msg.elapsed > msg.ttft) {
    tps = tokens / ((msg.elapsed - msg.ttft) / 1000); // measured here when the server has none
  }
  if (tps) items.push(["tok/s", tps.toFixed(1)]);
  if (msg.ttft != null) items.push(["TTFT", `${Math.round(msg.ttft)} ms`]);
  if (msg.elapsed != null) items.push(["elapsed", `${(msg.elapsed / 1000).toFixed(1)} s`]);
  if (d && d.speculative === false) items.push(["mode", "plain decoding"]);
  if (d && d.tau) items.push(["τ", d.tau.toFixed(2)]);
  if (d && d.acceptance_rate != null) items.push(["accepted", `${Math.round(d.acceptance_rate * 100)} %`]);
  if (d && d.block_size) {
    items.push(["block", d.block_policy === "auto" ? `auto ≤ ${d.block_size}` : String(d.block_size)]);
  }
  if (d && d.block_policy === "auto" && d.plain_share != null) {
    items.push(["plain", `${Math.round(d.plain_share * 100)} %`]);
  }
  const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
  if (cached != null) items.push(["cached prompt", String(cached)]);
  if (!items.length) return "";
  const list = items.map(([k, v]) => `<div><dt>${escapeHtml(k)}</dt><dd>${escapeHtml(v)}</dd></div>`);
  return `<div class="stats"><dl>${list.join("")}</dl>${histogramHtml(d)}</div>`;
}

// One bar per "i drafted tokens accepted in a cycle", height relative to the busiest bar.
function histogramHtml(d) {
  const hist = d && d.acceptance_histogram;
  if (!Array.isArray(hist) || !hist.some((n) => n > 0)) return "";
  const top = Math.max(...hist);
  const label = hist.map((n, i) => `${i} accepted: ${n}`).join(", ");
  const bars = hist.map((n, i) => {
    const h = Math.max(2, Math.round((n / top) * 100));
    return `<span class="bar" data-h="${h}" title="${i} accepted: ${n} cycles"></span>`;
  });
  return `<div class="hist" role="img" aria-label="Cycles by drafted tokens accepted: ${label}">` +
    `<span class="hist-label">acceptance</span><span class="bars">${bars.join("")}</span></div>`;
}
