// Images in the composer: attached with the button, pasted or dropped, shown as removable
// thumbnails until sent. Each becomes a data URL; one with more pixels than the server takes
// is scaled down here first (the server would resize it anyway), so requests stay small.

import { escapeHtml } from "./markdown.js";

const TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];

export class Attachments {
  constructor(tray, note) {
    this.tray = tray; // where the thumbnails of the next message are shown
    this.note = note; // a status line for what could not be attached
    this.items = []; // data URLs
    this.enabled = false; // the served model takes images (from /health)
    this.maxImages = 8;
    this.maxPixels = 1024 * 1024;
    tray.addEventListener("click", (e) => {
      const button = e.target.closest("button[data-index]");
      if (!button) return;
      this.items.splice(Number(button.dataset.index), 1);
      this.render();
    });
  }

  configure(health) {
    this.enabled = Boolean(health.vision);
    if (health.max_images != null) this.maxImages = health.max_images;
    if (health.max_image_pixels) this.maxPixels = health.max_image_pixels;
  }

  // Adds the image files among `files`; says why any other was left out.
  async add(files) {
    const problems = [];
    for (const file of files) {
      if (!this.enabled) {
        problems.push("this model takes no images");
        break;
      }
      if (!TYPES.includes(file.type)) {
        problems.push(`${file.name || "that file"} is not a PNG, JPEG, WebP or GIF image`);
      } else if (this.items.length >= this.maxImages) {
        problems.push(`at most ${this.maxImages} images per message`);
        break;
      } else {
        try {
          this.items.push(await dataUrl(file, this.maxPixels));
        } catch {
          problems.push(`${file.name || "that image"} cannot be read`);
        }
      }
    }
    this.note.textContent = problems.join("; ");
    this.render();
  }

  // The attached images, handed over to a message (the tray empties).
  take() {
    const items = this.items;
    this.items = [];
    this.note.textContent = "";
    this.render();
    return items;
  }

  render() {
    this.tray.hidden = this.items.length === 0;
    this.tray.innerHTML = this.items.map((url, i) =>
      `<span class="attached">${thumbHtml(url, `Attached image ${i + 1}`)}` +
      `<button type="button" class="remove" data-index="${i}" ` +
      `aria-label="Remove image ${i + 1}">×</button></span>`).join("");
  }
}

export function thumbHtml(url, alt) {
  return `<img class="thumb" src="${escapeHtml(url)}" alt="${escapeHtml(alt)}">`;
}

// A user message's images as thumbnails (above its text).
export function imagesHtml(msg) {
  const urls = msg.images || [];
  const shown = urls.map((url, i) => thumbHtml(url, `Image ${i + 1} you sent`)).join("");
  const lost = msg.imagesLost ? `<p class="notice">${msg.imagesLost} image(s) not kept ` +
    "(browser storage full)</p>" : "";
  return shown || lost ? `<div class="thumbs">${shown}</div>${lost}` : "";
}

// The content of a user message as the API wants it: text, or image parts then the text.
export function userContent(msg) {
  const urls = msg.images || [];
  if (!urls.length) return msg.content;
  const parts = urls.map((url) => ({ type: "image_url", image_url: { url } }));
  return msg.content ? [...parts, { type: "text", text: msg.content }] : parts;
}

// The image files a paste or a drop carries.
export function imageFiles(transfer) {
  return Array.from((transfer && transfer.files) || []).filter((f) => f.type.startsWith("image/"));
}

async function dataUrl(file, maxPixels) {
  const url = await new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
  const image = new Image();
  image.src = url;
  await image.decode();
  const pixels = image.naturalWidth * image.naturalHeight;
  if (pixels <= maxPixels) return url;
  const scale = Math.sqrt(maxPixels / pixels);
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.floor(image.naturalWidth * scale));
  canvas.height = Math.max(1, Math.floor(image.naturalHeight * scale));
  canvas.getContext("2d").drawImage(image, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL(file.type === "image/jpeg" ? "image/jpeg" : "image/png", 0.92);
}
