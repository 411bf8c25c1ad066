// The job's page (ui.py): asks /api/state when opened, on "Refresh", and every few seconds while in view; draws
// what it gets. Every string from the job is set as text, never parsed as markup.
"use strict";

const params = new URLSearchParams(location.search);
const token = params.get("token") || "";
const every = Math.max(1, Number(params.get("every")) || 5);
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d"];
let timer = null;
let busy = false;
let stopped = false;
let lastLook = 0;

function $(id) { return document.getElementById(id); }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function svg(tag, attrs, parent) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (parent) parent.appendChild(e);
  return e;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function seconds(s) { return s === null || s === undefined ? "?" : (s < 10 ? s.toFixed(2) : s.toFixed(1)) + " s"; }

function banner(text) {
  const box = $("ended");
  box.textContent = text;
  box.hidden = false;
}

async function refresh() {
  if (busy) return;
  busy = true;
  clearTimeout(timer);
  try {
    const r = await fetch("/api/state?token=" + encodeURIComponent(token), { cache: "no-store" });
    if (r.status === 403) {
      stopped = true;
      banner("This page's address does not hold the job's token: open the URL the job printed.");
      return;
    }
    if (!r.ok) {  // the server is there but could not look: say so, and ask again at the next refresh
      banner("The page's server answered " + r.status + ": " + (await r.text()));
      return;
    }
    const state = await r.json();
    lastLook = Date.now();
    render(state);
    if (state.ended) stopped = true;
  } catch (e) {
    stopped = true;
    banner("The job has ended, or the command serving this page stopped: " + location.host + " does not answer ("
          + e.message + "). What is below is the last look.");
    $("status").textContent += " · no answer since";
  } finally {
    busy = false;
    schedule();
  }
}

function schedule() {
  clearTimeout(timer);
  if (!stopped && $("auto").checked && !document.hidden) timer = setTimeout(refresh, every * 1000);
}

function render(s) {
  $("job").textContent = s.job || "";
  document.title = "nccl_pg: " + (s.ok === false ? "problem" : s.ended ? "ended" : "ok") + " · " + (s.job || "");
  if (s.ended) {
    banner(s.ended + ($("ranks").tBodies[0].rows.length ? ". What is below is the last look." : ""));
    $("status").textContent = "looked at " + new Date(s.asked_at * 1000).toLocaleTimeString();
    return;
  }
  $("ended").hidden = true;
  $("status").textContent = "incident " + s.incident + " · " + s.answered + " of " + (s.world ?? "?")
    + " ranks answered in " + seconds(s.waited_s) + " · looked at " + new Date(s.asked_at * 1000).toLocaleTimeString();
  renderVerdicts(s.verdicts || []);
  renderRanks(s.ranks || []);
  renderStacks(s.ranks || []);
  renderTimeline(s.timeline || { ranks: {}, now_ms: {} }, s.ranks || []);
  renderList("stragglers", s.stragglers || []);
  renderMembership(s.membership);
  renderList("notes", s.notes || [], "notes-section");
}

function renderVerdicts(verdicts) {
  const ul = $("verdicts");
  clear(ul);
  for (const v of verdicts) {
    const notice = !v.problem && v.kind !== "ok";
    ul.appendChild(el("li", v.text, v.problem ? "problem" : notice ? "notice" : ""));
  }
}

function renderRanks(ranks) {
  const body = $("ranks").tBodies[0];
  clear(body);
  for (const r of ranks) {
    const tr = el("tr");
    tr.dataset.rank = r.rank;
    if (r.culprit) tr.className = "culprit";
    else if (r.gone) tr.className = "gone";
    else if (!r.answered) tr.className = "silent";
    tr.appendChild(el("td", r.rank));
    tr.appendChild(el("td", r.host || ""));
    tr.appendChild(el("td", r.pid ?? ""));
    const state = r.gone ? "ended: " + r.gone : r.state;
    tr.appendChild(el("td", state, "state" + (r.culprit ? " state-culprit" : r.state === "in a collective"
                                                ? " state-waiting" : "")));
    tr.appendChild(el("td", r.where || "", "mono where"));
    const groups = el("td", null, "mono");
    for (const g of r.groups || []) {
      const line = "group " + g.group + (g.desc ? " (" + g.desc + ")" : "") + ": "
        + (g.in ? "in " + g.in + " for " + seconds(g.for_s) : "nothing in flight")
        + (g.last ? "; last " + g.last : "") + (g.state && g.state !== "open" ? " [" + g.state + "]" : "");
      groups.appendChild(el("div", line, "group"));
    }
    tr.appendChild(groups);
    const st = r.straggler;
    tr.appendChild(el("td", st ? st.score.toFixed(2) + (st.straggler ? " straggler" : "") : "",
                      st && st.straggler ? "straggler" : ""));
    body.appendChild(tr);
  }
}

function renderStacks(ranks) {
  const box = $("stacks");
  clear(box);
  const shown = ranks.filter((r) => r.stack && r.stack.length);
  $("stacks-section").hidden = shown.length === 0;
  for (const r of shown) {
    const d = el("details");
    d.open = true;
    const who = [r.host, r.pid ? "pid " + r.pid : ""].filter(Boolean).join(", ");
    d.appendChild(el("summary", "rank " + r.rank + (who ? " (" + who + ")" : "") + (r.where ? " at " + r.where : "")));
    const pre = el("pre");
    for (const [file, line, func, code] of r.stack) {
      const here = r.where === file + ":" + line + " in " + func;
      const span = el("span", "  File \"" + file + "\", line " + line + ", in " + func + "\n"
                      + (code ? "    " + code + "\n" : ""), here ? "user" : "");
      pre.appendChild(span);
    }
    d.appendChild(pre);
    box.appendChild(d);
  }
}

function renderTimeline(tl, ranks) {
  const box = $("timeline");
  clear(box);
  const rows = ranks.filter((r) => tl.ranks[String(r.rank)] !== undefined || !r.answered || r.gone);
  const groups = [...new Set(Object.values(tl.ranks).flat().map((e) => e.group))].sort();
  if (!rows.length) {
    box.appendChild(el("p", "no rank answered with its flight recorder", "legend"));
    return;
  }
  const all = Object.values(tl.ranks).flat();
  const done = all.filter((e) => e.end_ms !== null);
  const open = all.filter((e) => e.end_ms === null);
  const t0 = Math.min(...all.map((e) => e.start_ms), Infinity);
  let t1 = Math.max(...done.map((e) => e.end_ms), ...open.map((e) => e.start_ms), t0 + 1);
  const W = Math.max(640, Math.min(box.clientWidth || 1000, 1400));
  const LABEL = 150, TAIL = open.length ? 130 : 10, LANE = 14, GAP = 6;
  const plot = W - LABEL - TAIL;
  const span = Math.max(t1 - t0, 1);
  const x = (t) => LABEL + ((t - t0) / span) * plot;
  const laneOf = (g) => Math.max(0, groups.indexOf(g));
  const rowH = Math.max(1, groups.length) * LANE + GAP;
  const H = 24 + rows.length * rowH + 4;
  const root = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img",
                            "aria-label": "each rank's last collectives" });
  const axis = svg("g", { class: "axis" }, root);
  const step = niceStep(span / 6);
  for (let t = 0; t <= span + 1e-9; t += step) {
    svg("line", { x1: x(t0 + t), x2: x(t0 + t), y1: 16, y2: H }, axis);
    svg("text", { x: x(t0 + t) + 2, y: 12 }, axis).textContent = "+" + fmtMs(t);
  }
  if (open.length) {
    svg("text", { x: LABEL + plot + 8, y: 12 }, axis).textContent = "in flight →";
  }
  rows.forEach((r, i) => {
    const y = 20 + i * rowH;
    const row = svg("g", { class: "row", "data-rank": r.rank }, root);
    if (r.culprit) svg("rect", { x: 0, y: y - 2, width: W, height: rowH - 2, class: "row-culprit" }, row);
    const label = svg("text", { x: 4, y: y + LANE - 3 }, row);
    label.textContent = "rank " + r.rank + (r.gone ? " (ended)" : !r.answered ? " (no answer)" : "")
      + (r.culprit ? " ◀" : "");
    const entries = tl.ranks[String(r.rank)] || [];
    const now = tl.now_ms[String(r.rank)];
    for (const e of entries) {
      const lane = y + laneOf(e.group) * LANE;
      const color = COLORS[laneOf(e.group) % COLORS.length];
      const x0 = x(e.start_ms);
      const x1 = e.end_ms === null ? W - 4 : Math.max(x(e.end_ms), x0 + 2);
      const bar = svg("rect", { x: x0, y: lane, width: Math.max(2, x1 - x0), height: LANE - 3, fill: color,
                                stroke: "#fff", "stroke-width": 0.5,
                                "fill-opacity": e.end_ms === null ? 0.35 : 0.9,
                                class: e.end_ms === null ? "bar inflight" : "bar", "data-state": e.state }, row);
      const age = e.end_ms === null && now !== undefined ? " · in flight for " + fmtMs(now - e.start_ms) : "";
      svg("title", {}, bar).textContent = e.name + " · group " + e.group + " · " + e.state
        + (e.end_ms !== null ? " · " + fmtMs(e.end_ms - e.start_ms) : age);
      if (e.end_ms === null && now !== undefined) {
        const t = svg("text", { x: Math.max(x0, LABEL + plot) + 6, y: lane + LANE - 4 }, row);
        t.textContent = e.name.replace(/^.*?(#\d+)$/, "$1") + " " + fmtMs(now - e.start_ms);
      }
    }
    if (open.length && !entries.some((e) => e.end_ms === null)) {
      const t = svg("text", { x: LABEL + plot + 6, y: y + LANE - 4, class: "idle" }, row);
      t.textContent = r.answered ? "nothing in flight" : "no answer";
    }
  });
  box.appendChild(root);
  const legend = $("legend");
  clear(legend);
  legend.appendChild(document.createTextNode("Bars: a collective from its issue to its completion on that rank, one "
    + "lane per group (" + groups.map((g, i) => "group " + g + ": lane " + (i + 1)).join(", ") + "); dashed: not "
    + "completed when the rank answered. A rank with no bar where the others wait never issued it; a straggler's "
    + "bars are short (it arrives last, when the others have waited for it)."
    + (tl.left_out ? " " + tl.left_out + " more ranks not drawn." : "")));
}

function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(Math.max(raw, 1e-3))));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function fmtMs(ms) {
  if (ms >= 1000) return (ms / 1000).toFixed(ms >= 10000 ? 0 : 1) + " s";
  return (ms >= 10 ? ms.toFixed(0) : ms.toFixed(1)) + " ms";
}

function renderList(id, lines, section) {
  const ul = $(id);
  clear(ul);
  for (const l of lines) ul.appendChild(el("li", l));
  if (section) $(section).hidden = lines.length === 0;
}

function renderMembership(m) {
  $("membership-section").hidden = !m;
  const body = $("membership").tBodies[0];
  clear(body);
  for (const c of (m || []).slice().reverse()) {
    const tr = el("tr");
    tr.appendChild(el("td", c.uuid ?? "?"));
    tr.appendChild(el("td", c.members.join(", "), "mono"));
    tr.appendChild(el("td", c.why));
    body.appendChild(tr);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("every").textContent = String(every);
  $("json").href = "/api/state?token=" + encodeURIComponent(token);
  $("refresh").addEventListener("click", () => { stopped = false; refresh(); });
  $("auto").addEventListener("change", schedule);
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) clearTimeout(timer);
    else if (!stopped && Date.now() - lastLook >= every * 1000) refresh();
    else schedule();
  });
  refresh();
});
