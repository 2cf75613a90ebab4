// A small, safe Markdown renderer for chat messages.
//
// Safety rule: the text is HTML-escaped FIRST, then only tags this file writes itself are added
// (links only for http(s)/mailto URLs). Nothing the model writes can become markup or script;
// the page's Content-Security-Policy is a second fence.
//
// Supported: fenced code blocks (an unclosed fence runs to the end, as while streaming), inline
// code, headings, bold, italic, strikethrough, links, bullet and numbered lists, block quotes,
// horizontal rules and paragraphs.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Inline formatting on already-escaped text. Code spans are cut out first so nothing inside
// them is formatted.
function inline(escaped) {
  const codes = [];
  let out = escaped.replace(/`([^`\n]+)`/g, (_, code) => {
    codes.push(`<code>${code}</code>`);
    return `\u0000${codes.length - 1}\u0000`;
  });
  out = out
    .replace(/\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_\n]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*(\S(?:[^*\n]*\S)?)\*(?!\w)/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_(\S(?:[^_\n]*\S)?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
}

function codeBlock(lang, lines) {
  const cls = /^[\w+-]+$/.test(lang) ? ` class="language-${lang}"` : "";
  const label = cls ? `<span class="code-lang">${lang}</span>` : "";
  return `<div class="code">${label}<pre><code${cls}>${lines.join("\n")}</code></pre></div>`;
}

const BLOCK_START = /^(#{1,6}\s|&gt;|\s*[-*+]\s|\s*\d+[.)]\s|```|~~~|\s*([-*_])(\s*\2){2,}\s*$)/;

// Markdown text -> HTML string (safe to assign to innerHTML).
export function renderMarkdown(text) {
  const lines = escapeHtml(text.replace(/\r\n?/g, "\n")).split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([^\s`]*)/);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i += 1; // the closing fence (or past the end)
      html.push(codeBlock(fence[2], body));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const level = heading[1].length;
      html.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      html.push("<hr>");
      i += 1;
      continue;
    }
    if (line.startsWith("&gt;")) {
      const quoted = [];
      while (i < lines.length && lines[i].startsWith("&gt;")) {
        quoted.push(lines[i++].replace(/^&gt;\s?/, ""));
      }
      html.push(`<blockquote>${renderEscaped(quoted)}</blockquote>`);
      continue;
    }
    const list = line.match(/^\s*([-*+]|\d+[.)])\s+/);
    if (list) {
      const ordered = /\d/.test(list[1]);
      const pattern = ordered ? /^\s*\d+[.)]\s+(.*)$/ : /^\s*[-*+]\s+(.*)$/;
      const items = [];
      while (i < lines.length) {
        const item = lines[i].match(pattern);
        if (item) items.push(inline(item[1]));
        else if (lines[i].trim() && /^\s{2,}/.test(lines[i]) && items.length) {
          items[items.length - 1] += ` ${inline(lines[i].trim())}`; // continuation line
        } else break;
        i += 1;
      }
      const tag = ordered ? "ol" : "ul";
      html.push(`<${tag}>${items.map((it) => `<li>${it}</li>`).join("")}</${tag}>`);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !BLOCK_START.test(lines[i])) {
      para.push(inline(lines[i++]));
    }
    if (!para.length) para.push(inline(lines[i++])); // a line no block rule took
    html.push(`<p>${para.join("<br>")}</p>`);
  }
  return html.join("");
}

// Block quotes hold escaped lines already: render them without escaping twice.
function renderEscaped(lines) {
  const unescaped = lines.join("\n").replace(/&(amp|lt|gt|quot|#39);/g, (m) => ({
    "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'",
  })[m]);
  return renderMarkdown(unescaped);
}
