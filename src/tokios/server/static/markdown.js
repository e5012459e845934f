// Renders a reply's markdown into an element, safely: model output is untrusted. Three layers:
// 1. marked renders raw HTML in the markdown as escaped text (a reply that writes <script> shows
//    the characters, as a chat should), and images as plain links (nothing loads by itself);
// 2. DOMPurify sanitizes what marked produced (no javascript: URLs, no event handlers);
// 3. code blocks are highlighted by highlight.js, which reads text and writes escaped spans.
// Without the libraries (not installed: see server/web_assets.py) the text is shown as plain text.
"use strict";

const SANITIZE_OPTIONS = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "img", "form", "input", "button", "iframe", "object", "embed", "svg", "math"],
  FORBID_ATTR: ["style"],
};

export const isMarkdownAvailable = typeof window.marked !== "undefined" && typeof window.DOMPurify !== "undefined";
const isHighlightAvailable = typeof window.hljs !== "undefined";

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (char) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[char]);
}

if (isMarkdownAvailable) {
  window.marked.use({
    gfm: true,
    breaks: true,
    renderer: {
      html({ text }) {
        return escapeHtml(text);
      },
      image({ href, text }) {
        return `<a href="${escapeHtml(href || "")}">${escapeHtml(`image: ${text || href || ""}`)}</a>`;
      },
    },
  });
  // Links leave the page in a new tab, without handing it this page (window.opener).
  window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}
if (isHighlightAvailable) window.hljs.configure({ ignoreUnescapedHTML: true });

// Copies text to the clipboard; the fallback serves pages opened over plain HTTP from another
// machine, where navigator.clipboard does not exist.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

export function copyButton(getText, label = "Copy") {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy";
  button.textContent = label;
  button.addEventListener("click", async () => {
    try {
      await copyText(getText());
      button.textContent = "Copied";
    } catch (err) {
      button.textContent = "Copy failed";
    }
    setTimeout(() => { button.textContent = label; }, 1500);
  });
  return button;
}

export function renderMarkdown(element, text) {
  if (!isMarkdownAvailable) {
    element.classList.add("plain");
    element.textContent = text;
    return;
  }
  let html;
  try {
    html = window.DOMPurify.sanitize(window.marked.parse(text), SANITIZE_OPTIONS);
  } catch (err) {
    // Input the renderer cannot take (thousands of nested quotes, say) is shown as it is.
    element.classList.add("plain");
    element.textContent = text;
    return;
  }
  element.classList.remove("plain");
  element.innerHTML = html;
  for (const code of element.querySelectorAll("pre > code")) {
    if (isHighlightAvailable) window.hljs.highlightElement(code);
    const pre = code.parentElement;
    const bar = document.createElement("div");
    bar.className = "code-bar";
    const language = [...code.classList].find((name) => name.startsWith("language-"));
    const label = document.createElement("span");
    label.textContent = language ? language.slice("language-".length) : "code";
    bar.append(label, copyButton(() => code.textContent, "Copy code"));
    pre.prepend(bar);
  }
}
