// A small line plot on a canvas: the last POINTS values of a few series, from 0 up to a fixed
// maximum or the largest value shown. Drawn with the canvas API (nothing inline, no library).
"use strict";

const POINTS = 120;

class LinePlot {
  // series: [{label, color}]; options: {max: a fixed top (e.g. 1 for a fraction) or null,
  // format: value -> text for the top label}
  constructor(canvas, series, options) {
    this.canvas = canvas;
    this.series = series.map((s) => Object.assign({ values: [] }, s));
    this.max = options && options.max !== undefined ? options.max : null;
    this.format = (options && options.format) || ((v) => String(Math.round(v)));
  }

  // One value per series (null: no value at this point).
  push(values) {
    this.series.forEach((s, i) => {
      s.values.push(values[i]);
      if (s.values.length > POINTS) s.values.shift();
    });
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const seen = this.series.flatMap((s) => s.values.filter((v) => v !== null));
    const top = this.max !== null ? this.max : Math.max(1, ...seen) * 1.1;
    const pad = { left: 4, right: 4, top: 16, bottom: 4 };
    const w = width - pad.left - pad.right;
    const h = height - pad.top - pad.bottom;
    ctx.strokeStyle = "#d6dbe3";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const y = pad.top + (h * i) / 4 + 0.5;
      ctx.beginPath();
      ctx.moveTo(pad.left, y);
      ctx.lineTo(pad.left + w, y);
      ctx.stroke();
    }
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#5b6472";
    ctx.textBaseline = "top";
    ctx.fillText(this.format(top), pad.left, 2);
    let x = width - pad.right;
    for (const s of [...this.series].reverse()) {
      const label = s.label;
      x -= ctx.measureText(label).width;
      ctx.fillStyle = s.color;
      ctx.fillText(label, x, 2);
      x -= 12;
    }
    for (const s of this.series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let drawing = false;
      s.values.forEach((v, i) => {
        if (v === null) {
          drawing = false;
          return;
        }
        const px = pad.left + (w * (POINTS - s.values.length + i)) / (POINTS - 1);
        const py = pad.top + h - (h * Math.min(v, top)) / top;
        if (drawing) ctx.lineTo(px, py);
        else ctx.moveTo(px, py);
        drawing = true;
      });
      ctx.stroke();
    }
  }
}
