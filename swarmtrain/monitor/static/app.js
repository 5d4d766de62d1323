// swarmtrain monitor: renders the state sent by /events (server-sent events). No dependencies.
"use strict";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined) return "–";
  return Number(x).toFixed(digits === undefined ? 3 : digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "unknown";
  if (seconds < 90) return seconds.toFixed(0) + " s";
  if (seconds < 5400) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

// A line chart of [time, value] points as SVG (values null are skipped).
function chart(title, points) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", "0 0 400 140");
  svg.setAttribute("preserveAspectRatio", "none");
  const pts = points.filter((p) => p[1] !== null && Number.isFinite(p[1]));
  const box = el("div", { class: "chart" }, el("h3", {}, title));
  if (pts.length > 0) {
    const t0 = pts[0][0], t1 = pts[pts.length - 1][0];
    let lo = Math.min(...pts.map((p) => p[1])), hi = Math.max(...pts.map((p) => p[1]));
    if (hi === lo) { hi += 1; lo -= 1; }
    const x = (t) => (t1 === t0 ? 200 : 5 + ((t - t0) / (t1 - t0)) * 390);
    const y = (v) => 130 - ((v - lo) / (hi - lo)) * 120;
    const line = document.createElementNS(svgNS, "polyline");
    line.setAttribute("points", pts.map((p) => x(p[0]) + "," + y(p[1])).join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#2563eb");
    line.setAttribute("stroke-width", "2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
    box.querySelector("h3").append(" — now " + fmt(pts[pts.length - 1][1]) +
      " (range " + fmt(lo) + " … " + fmt(hi) + ")");
  }
  box.append(svg);
  return box;
}

function renderRun(runId, run) {
  const section = el("section", { class: "run", "data-run": runId });
  const ann = run.announcement;
  section.append(el("h2", {}, runId + (ann && ann.name ? " — " + ann.name : "")));
  if (ann && ann.description) section.append(el("p", {}, ann.description));
  const peers = run.peers || [];
  const totalRate = peers.reduce((s, p) => s + p.samples_per_second, 0);
  const stats = el("div", {},
    el("span", { class: "stat" }, "alive peers ", el("b", { class: "alive" }, peers.length)),
    el("span", { class: "stat" }, "samples/s ", el("b", {}, fmt(totalRate, 1))));
  if (run.progress) {
    stats.append(el("span", { class: "stat" }, "epoch ", el("b", {}, run.progress.epoch)));
    const target = run.progress.target_batch_size;
    stats.append(el("span", { class: "stat" }, "samples this epoch ",
      el("b", {}, run.progress.samples + (target ? " / " + target : ""))));
    stats.append(el("span", { class: "stat" }, "next epoch in ",
      el("b", { class: "eta" }, duration(run.progress.eta_seconds))));
  }
  section.append(stats);
  const history = run.history || [];
  section.append(el("div", { class: "charts" },
    chart("mean loss", history.map((p) => [p[0], p[1]])),
    chart("samples/s (swarm)", history.map((p) => [p[0], p[2]]))));
  const table = el("table", {}, el("tr", {}, ...["peer", "role", "reachability", "epoch", "step",
    "loss", "samples/s", "version", "last report"].map((h) => el("th", {}, h))));
  const now = Date.now() / 1000;
  for (const p of peers) {
    table.append(el("tr", { class: "peer" }, ...[p.peer_id.slice(0, 16) + "…", p.role,
      p.reachability, p.epoch, p.step, fmt(p.loss), fmt(p.samples_per_second, 1), p.version,
      duration(Math.max(0, now - p.time)) + " ago"].map((c) => el("td", {}, c))));
  }
  section.append(table);
  // Failures and warnings are text from other peers: el() appends them as text nodes, never
  // as markup.
  const failures = run.failures || [];
  if (failures.length) {
    const list = el("table", { class: "failures" }, el("tr", {}, ...["when", "peer", "kind",
      "message"].map((h) => el("th", {}, h))));
    for (const f of failures) {
      list.append(el("tr", { class: "failure" },
        el("td", {}, duration(Math.max(0, now - f.time)) + " ago"),
        el("td", {}, String(f.peer_id).slice(0, 16) + "…"),
        el("td", { class: "kind" }, String(f.kind)),
        el("td", { class: "message" }, String(f.message))));
    }
    section.append(el("h3", {}, "Recent failures and warnings"), list);
  }
  if (ann) {
    const join = [];
    if (ann.command) join.push("join with: " + ann.command);
    if (ann.initial_peers && ann.initial_peers.length) join.push("initial peers: " + ann.initial_peers.join(" "));
    if (ann.requirements) join.push("requirements: " + ann.requirements);
    if (ann.model) join.push("model: " + ann.model);
    if (ann.private) join.push("private run: ask the organisers for the swarm key");
    if (ann.announcer) join.push("announced by peer " + ann.announcer +
      (ann.announced_by_initial_peer ? " (one of its initial peers)" : " (not an initial peer)"));
    if (join.length) section.append(el("h3", {}, "How to join"), el("div", { class: "join" }, join.join("\n")));
  }
  const trustText = {
    owner: "signed by the run's owner key ",
    unsigned: "unsigned announcement: anyone can announce this run_id; check the bootstrap address with the organisers",
    conflict: "UNTRUSTED: several owner keys claim this run_id; ask the organisers for theirs",
    impostor: "UNTRUSTED: not signed by this run_id's owner key",
  };
  if (ann) {
    const text = (trustText[ann.trust] || "") + (ann.trust === "owner" ? ann.owner_key : "");
    section.append(el("p", { class: "trust trust-" + ann.trust }, text));
  }
  const others = run.other_announcers || [];
  if (others.length) {
    const list = el("ul", { class: "others" });
    for (const o of others) {
      list.append(el("li", { class: "announcer trust-" + o.trust }, "peer " + o.announcer + ": " +
        (trustText[o.trust] || o.trust) + (o.trust === "owner" ? o.owner_key : "") +
        (o.initial_peers && o.initial_peers.length ? " — points to " + o.initial_peers.join(" ") : "")));
    }
    section.append(el("h3", {}, "Other announcers of this run_id"), list);
  }
  return section;
}

function render(state) {
  const main = document.getElementById("runs");
  const runs = Object.entries(state.runs || {});
  main.replaceChildren(...(runs.length ? runs.map(([id, run]) => renderRun(id, run))
    : [el("p", { class: "muted" }, "no runs found yet")]));
  document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
}

if (window.SWARMTRAIN_STATE && window.SWARMTRAIN_STATE.runs) render(window.SWARMTRAIN_STATE);
const events = new EventSource("/events");
events.addEventListener("state", (e) => render(JSON.parse(e.data)));
events.onerror = () => { document.getElementById("status").textContent = "reconnecting…"; };
