// The avatar's face, drawn by the page as SVG: a mouth shaped by the 15 Oculus/Meta visemes, eyes that blink,
// a head that drifts a little while idle. Shapes are parameters (width, opening, rounding, teeth, tongue),
// blended toward rest by a viseme's weight.
const NS = "http://www.w3.org/2000/svg";
export const VISEMES = ["sil", "PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "ih", "oh", "ou"];

// width: ×rest; open: 0 (closed) to 1; round: pucker 0-1; teeth / tongue shown
const SHAPES = {
  sil: { width: 1.0, open: 0.0, round: 0.0 },
  PP: { width: 0.92, open: 0.0, round: 0.1, pressed: true },
  FF: { width: 1.0, open: 0.16, round: 0.0, teeth: true },
  TH: { width: 1.0, open: 0.22, round: 0.0, teeth: true, tongue: true },
  DD: { width: 1.02, open: 0.3, round: 0.0, teeth: true },
  kk: { width: 1.0, open: 0.36, round: 0.0 },
  CH: { width: 0.82, open: 0.3, round: 0.35, teeth: true },
  SS: { width: 1.08, open: 0.14, round: 0.0, teeth: true },
  nn: { width: 1.0, open: 0.2, round: 0.0, tongue: true },
  RR: { width: 0.78, open: 0.26, round: 0.45 },
  aa: { width: 1.0, open: 0.85, round: 0.05 },
  E: { width: 1.12, open: 0.5, round: 0.0, teeth: true },
  ih: { width: 1.08, open: 0.36, round: 0.0, teeth: true },
  oh: { width: 0.74, open: 0.62, round: 0.7 },
  ou: { width: 0.58, open: 0.36, round: 0.9 },
};

const CX = 100, CY = 150, HALF_WIDTH = 34, MAX_OPEN = 36;

function el(name, attrs, parent) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function mouthPath(width, open, round) {
  const hw = HALF_WIDTH * width;
  const h = MAX_OPEN * open;
  const up = 3 + h * 0.45 + round * 4; // upper lip rises less than the jaw drops
  const down = 3 + h * 0.85 + round * 3;
  const corner = round * hw * 0.35; // puckered lips round the corners
  return `M ${CX - hw} ${CY} C ${CX - hw + corner} ${CY - up}, ${CX + hw - corner} ${CY - up}, ${CX + hw} ${CY} ` +
    `C ${CX + hw - corner} ${CY + down}, ${CX - hw + corner} ${CY + down}, ${CX - hw} ${CY} Z`;
}

export class Face {
  constructor(container) {
    const svg = el("svg", { viewBox: "0 0 200 220", class: "face", role: "img", "aria-label": "the avatar's face" });
    this.svg = svg;
    const defs = el("defs", {}, svg);
    const clip = el("clipPath", { id: "mouth-clip" }, defs);
    this.clipPath = el("path", {}, clip);
    this.head = el("g", { class: "head" }, svg);
    el("ellipse", { cx: 100, cy: 112, rx: 78, ry: 96, class: "skin" }, this.head);
    el("path", { d: "M 22 104 C 14 -6, 186 -6, 178 104 C 170 60, 126 46, 100 48 C 74 46, 30 60, 22 104 Z", class: "hair" }, this.head);
    this.eyes = [70, 130].map((x) => {
      const g = el("g", {}, this.head);
      el("ellipse", { cx: x, cy: 100, rx: 13, ry: 9, class: "eye-white" }, g);
      el("circle", { cx: x, cy: 100, r: 5.5, class: "iris" }, g);
      return el("rect", { x: x - 15, y: 88, width: 30, height: 0, class: "lid" }, g);
    });
    el("path", { d: "M 98 108 Q 94 128 100 132 Q 104 133 106 130", class: "nose" }, this.head);
    const mouth = el("g", { class: "mouth" }, this.head);
    this.inner = el("path", { class: "mouth-inner" }, mouth);
    const inside = el("g", { "clip-path": "url(#mouth-clip)" }, mouth);
    this.teeth = el("rect", { x: CX - 30, y: CY - 16, width: 60, height: 11, class: "teeth" }, inside);
    this.tongue = el("ellipse", { cx: CX, cy: CY + 12, rx: 16, ry: 8, class: "tongue" }, inside);
    this.lips = el("path", { class: "lips" }, mouth);
    container.appendChild(svg);
    this.viseme = null;
    this.weight = 0;
    this.show("sil", 1);
    this.nextBlink = performance.now() + 1500;
    this.blinkUntil = 0;
  }

  /** Shape the mouth as `viseme` at `weight` (0: rest); true when what is drawn changed. */
  show(viseme, weight = 1) {
    const w = Math.round(Math.max(0, Math.min(1, weight)) * 20) / 20;
    if (viseme === this.viseme && w === this.weight) return false;
    const shape = SHAPES[viseme] || SHAPES.sil;
    const rest = SHAPES.sil;
    const mix = (k) => rest[k] + (shape[k] - rest[k]) * w;
    const d = mouthPath(mix("width"), mix("open"), mix("round"));
    this.inner.setAttribute("d", d);
    this.lips.setAttribute("d", d);
    this.clipPath.setAttribute("d", d);
    this.lips.classList.toggle("pressed", Boolean(shape.pressed));
    this.teeth.style.display = shape.teeth && w > 0.3 ? "" : "none";
    this.tongue.style.display = shape.tongue && w > 0.3 ? "" : "none";
    this.svg.dataset.viseme = viseme;
    this.viseme = viseme;
    this.weight = w;
    return true;
  }

  /** Blinks and an idle drift; call once a frame. */
  tick(now, speaking) {
    if (now >= this.nextBlink) {
      this.blinkUntil = now + 130;
      this.nextBlink = now + 2200 + Math.random() * 3800;
    }
    const closed = now < this.blinkUntil;
    for (const lid of this.eyes) lid.setAttribute("height", closed ? 24 : 0);
    this.svg.dataset.blinking = closed ? "1" : "0";
    const drift = speaking ? 0 : Math.sin(now / 1400) * 1.6;
    this.head.setAttribute("transform", `translate(0 ${drift.toFixed(2)}) rotate(${(drift * 0.6).toFixed(2)} 100 110)`);
  }
}
