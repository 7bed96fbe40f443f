// relaytrain's web page: the job list and a job's page, read from the /v1 API.
// Plain JavaScript, no build step, nothing from another host.  Data is written with
// textContent (never as markup), except the swimlane SVG the server renders and escapes.
"use strict";

const TOKEN_KEY = "relaytrain.token";
const SVG_NS = "http://www.w3.org/2000/svg";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);  // QUEUED is active: it may be cancelled
const TRAINING = new Set(["RUNNING", "RESHAPING"]);  // it may be told to finish early
const POLL_MS = { list: 2000, active: 1500, ended: 15000 };

const $ = (sel, root = document) => root.querySelector(sel);
let token = sessionStorage.getItem(TOKEN_KEY) || "";
let timer = null;
let view = null;       // the current page's state
let generation = 0;    // bumps on navigation: a stale refresh does not draw

class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
  }
}

async function api(path, { method = "GET", as = "json" } = {}) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { method, headers });
  if (r.status === 401) {
    showLogin(token ? "That token was not accepted." : "");
    throw new ApiError(401, "unauthorized");
  }
  if (!r.ok) {
    let detail = r.statusText;
    try { detail = (await r.json()).detail; } catch (e) { /* not JSON */ }
    throw new ApiError(r.status, detail);
  }
  return as === "text" ? r.text() : r.json();
}

// ------------------------------------------------------------------ helpers

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text != null) node.textContent = text;
  return node;
}

// Python's json writes bare NaN and Infinity, which JSON.parse rejects: read them as null (a gap)
function parseJson(text) {
  try {
    return JSON.parse(text);
  } catch (e) {
    return JSON.parse(text.replace(/("(?:[^"\\]|\\.)*")|-?\bInfinity\b|\bNaN\b/g, (m, str) => str || "null"));
  }
}

const finite = (x) => typeof x === "number" && Number.isFinite(x);

function fmtNum(x, digits = 4) {
  if (x == null || Number.isNaN(x)) return "–";
  if (!Number.isFinite(x)) return "not finite";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return Number(x.toPrecision(digits)).toString();
}

// learning rates: one notation down an axis (1e-3, 7.5e-4, 5e-4, ...)
function fmtRate(x) {
  if (!finite(x) || x === 0 || Math.abs(x) >= 0.01) return fmtNum(x);
  return x.toExponential(3).replace(/\.?0+e/, "e").replace("e+", "e");
}

function fmtSpeed(x) { return x == null ? "–" : x >= 100 ? Math.round(x).toLocaleString() : fmtNum(x, 3); }
function fmtPct(x) { return x == null || x === "" ? "–" : (100 * Number(x)).toFixed(1) + "%"; }

function fmtDuration(s) {
  if (s == null) return "–";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
}

function fmtAgo(t) {
  if (!t) return "–";
  const s = Date.now() / 1000 - t;
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return new Date(t * 1000).toLocaleDateString();
}

function fmtClock(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }

// a shape as the CLI and the timeline say it (service/replicas.py shape_label): 1×3 replicas [1,2,1], 1×2×2 (tp)
function shapeText(shape) {
  if (!shape || shape.dp == null) return "–";
  return `${shape.dp}×${shape.pp}` + (shape.replicas ? ` replicas [${shape.replicas.join(",")}]` : "") +
    (shape.tp > 1 ? `×${shape.tp} (tp)` : "") + ` · ${shape.schedule || ""}`;
}

function badge(state) { return el("span", { class: "badge " + state, "data-state": state, text: state }); }

// 1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st
function ordinal(n) {
  const tens = n % 100, ones = n % 10;
  const suffix = tens >= 11 && tens <= 13 ? "th" : ones === 1 ? "st" : ones === 2 ? "nd" : ones === 3 ? "rd" : "th";
  return `${n}${suffix}`;
}

// a QUEUED job's place in the cluster scheduler's queue and what it waits for
function queueText(job) {
  const q = job.queue;
  if (q && q.position != null) return `${ordinal(q.position)} in the queue: ${q.reason}`;
  return "queued: waiting for the cluster scheduler to look at it";
}

function progressCell(job) {
  const bar = el("div", { class: "progress-bar" });
  bar.style.width = `${job.steps ? (100 * job.step) / job.steps : 0}%`;
  return el("div", { class: "progress-cell" }, el("div", { class: "progress" }, bar),
    el("span", { text: `${job.step} / ${job.steps}` }));
}

function showBanner(msg) {
  const b = $("#banner");
  b.textContent = msg || "";
  b.hidden = !msg;
}

function setLive(on) { $("#live").classList.toggle("paused", !on); $("#live").textContent = on ? "live" : "ended"; }

// ------------------------------------------------------------------ sign in

function showLogin(message) {
  for (const id of ["view-list", "view-job"]) $("#" + id).hidden = true;
  $("#login").hidden = false;
  $("#login-error").hidden = !message;
  $("#login-error").textContent = message || "";
  $("#token").focus();
  stop();
}

$("#login-form").addEventListener("submit", (e) => {
  e.preventDefault();
  token = $("#token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, token);
  $("#token").value = "";
  $("#login").hidden = true;
  $("#forget-token").hidden = !token;
  route();
});

$("#forget-token").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  token = "";
  $("#forget-token").hidden = true;
  showLogin("");
});

// ------------------------------------------------------------------ routing and polling

function stop() { if (timer) clearTimeout(timer); timer = null; }

function schedule(fn, ms) { stop(); timer = setTimeout(fn, ms); }

function route() {
  stop();
  generation += 1;
  $("#forget-token").hidden = !token;
  const m = location.hash.match(/^#\/jobs\/([^/?]+)/);
  if (m) openJob(decodeURIComponent(m[1]));
  else openList();
}

window.addEventListener("hashchange", route);

// ------------------------------------------------------------------ the job list

function openList() {
  $("#view-job").hidden = true;
  $("#view-list").hidden = false;
  view = { kind: "list" };
  refreshList(generation);
}

$("#state-filter").addEventListener("change", () => { if (view && view.kind === "list") route(); });

async function refreshList(gen) {
  try {
    const state = $("#state-filter").value;
    const [page, cluster] = await Promise.all([api(`/v1/jobs?limit=200${state ? "&state=" + state : ""}`),
                                               api("/v1/cluster").catch((e) => e)]);
    if (gen !== generation) return;
    drawCluster(cluster instanceof Error ? null : cluster);
    showBanner("");
    const body = $("#jobs tbody");
    body.replaceChildren(...page.items.map((job) => {
      const link = el("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, class: "name", text: job.name });
      const row = el("tr", { class: "clickable", "data-job-id": job.id, "data-state": job.state },
        el("td", { class: "job-cell" }, link, el("div", { class: "id mono", text: job.id })),
        el("td", {}, job.state === "QUEUED" ? Object.assign(badge(job.state), { title: queueText(job) }) : badge(job.state)),
        el("td", { text: shapeText(job.shape) }),
        el("td", {}, progressCell(job)),
        el("td", { class: "num", text: fmtNum(job.loss) }),
        el("td", { class: "num", text: job.state === "QUEUED" ? "–" : fmtSpeed(job.samples_per_s) }),
        el("td", { class: "muted", text: fmtAgo(job.created_at), title: new Date(job.created_at * 1000).toString() }));
      row.addEventListener("click", (e) => { if (e.target.tagName !== "A") location.hash = link.getAttribute("href"); });
      return row;
    }));
    $("#jobs-empty").hidden = page.items.length > 0;
    $("#jobs-total").textContent = page.total > page.items.length ? `${page.items.length} of ${page.total} jobs` : "";
    setLive(true);
  } catch (e) {
    if (e.status === 401) return;
    if (gen === generation) showBanner(`Could not load the jobs: ${e.message}`);
  }
  if (gen === generation) schedule(() => refreshList(gen), POLL_MS.list);
}

// The cluster panel (GET /v1/cluster): the scheduler's policy and capacity, each tenant's
// weight, fair share and use, and how many jobs wait.  Hidden when the server does not say.
function drawCluster(c) {
  const panel = $("#cluster-panel");
  panel.hidden = !c;
  if (!c) return;
  const tenants = c.tenants || [], queue = c.queue || [];
  panel.dataset.policy = c.policy;
  $("#cluster-policy").textContent = c.policy;
  $("#cluster-capacity").textContent = fmtNum(c.capacity, 3);
  const waiting = $("#cluster-queue");
  waiting.textContent = queue.length ? `${queue.length} job${queue.length === 1 ? "" : "s"}` : "empty";
  waiting.dataset.length = String(queue.length);
  waiting.title = queue.map((q) => `${q.position}. ${q.job || `a job of tenant ${q.tenant}`}: ${q.reason}`).join("\n");
  $("#cluster-tenants").hidden = !tenants.length;
  $("#cluster-idle").hidden = tenants.length > 0;
  $("#cluster-tenants tbody").replaceChildren(...tenants.map((t) => {
    const over = t.using + (t.starting || 0) > t.share + 1e-9;
    return el("tr", { "data-tenant": t.tenant, class: over ? "over" : "" },
      el("td", { class: "mono", text: t.tenant }),
      el("td", { class: "num", text: fmtNum(t.weight, 3) }),
      el("td", { class: "num", text: fmtNum(t.share, 3) }),
      el("td", { class: "num using", text: fmtNum(t.using, 3),
                 title: over ? "above its weighted share: elastic jobs may shrink when others wait" : "" }),
      el("td", { class: "num starting", text: fmtNum(t.starting || 0, 3) }),
      el("td", { class: "num", text: String(t.running) }),
      el("td", { class: "num", text: String(t.queued) }));
  }));
}

// ------------------------------------------------------------------ a job's page

function openJob(id) {
  $("#view-list").hidden = true;
  $("#view-job").hidden = false;
  view = { kind: "job", id, metrics: [], lastStep: 0, events: [], eventsAfter: 0, timelineKey: null,
           pinned: null, job: null, output: [], outputAfter: 0, detailStep: null };
  $("#job-name").textContent = id;
  $("#job-id").textContent = id;
  $("#events").replaceChildren();
  $("#output").textContent = "";
  $("#output").dataset.lines = "0";
  $("#swimlane").replaceChildren(el("p", { class: "empty", text: "No step measured yet." }));
  $("#timeline-step").replaceChildren(el("option", { value: "", text: "latest" }));
  $("#util-measured").textContent = $("#util-plan").textContent = "–";
  for (const id of ["#loss-curve", "#speed-curve", "#lr-curve", "#grad-curve", "#loss-legend", "#grad-legend",
                    "#step-detail"]) $(id).replaceChildren();
  $("#recipe-charts").hidden = true;
  $("#step-detail").hidden = true;
  $("#legend-eval").hidden = true;
  $("#job-error").hidden = true;
  refreshJob(generation);
}

async function refreshJob(gen) {
  const v = view;
  let job;
  try {
    job = await api(`/v1/jobs/${encodeURIComponent(v.id)}`);
    if (gen !== generation) return;
    v.job = job;
    showBanner("");
    drawJobHead(job);
    await loadMetrics(v);
    if (TERMINAL.has(job.state) && job.step < v.lastStep) {  // finished early after a restart went back: the
      v.metrics = v.metrics.filter((r) => r.step <= job.step);  // rows past its end are gone from the server too
      v.lastStep = job.step;
    }
    await loadEvents(v);
    await loadOutput(v);
    if (gen !== generation) return;
    const drawn = `${v.metrics.length}:${v.events.length}`;
    if (drawn !== v.drawn) { drawCharts(v); v.drawn = drawn; }
    drawShape(job);
    await loadTimeline(v, job, gen);
    setLive(!TERMINAL.has(job.state));
  } catch (e) {
    if (e.status === 401 || gen !== generation) return;
    if (e.status === 404) { showBanner(`No job ${v.id} (or it belongs to another tenant).`); return; }
    showBanner(`Could not load job ${v.id}: ${e.message}`);
  }
  if (gen === generation) schedule(() => refreshJob(gen), job && TERMINAL.has(job.state) ? POLL_MS.ended : POLL_MS.active);
}

function drawJobHead(job) {
  $("#job-name").textContent = job.name;
  $("#job-id").textContent = job.id;
  $("#job-state").replaceWith(Object.assign(badge(job.state), { id: "job-state" }));
  $("#view-job").setAttribute("data-job-id", job.id);
  $("#view-job").setAttribute("data-state", job.state);
  $("#job-progress-bar").style.width = `${job.steps ? (100 * job.step) / job.steps : 0}%`;
  $("#job-progress").textContent = `${job.step} / ${job.steps} steps`;
  $("#job-loss").textContent = fmtNum(job.loss);
  $("#job-speed").textContent = job.state === "QUEUED" ? "–" : fmtSpeed(job.samples_per_s);
  $("#job-shape").textContent = shapeText(job.shape);
  const end = job.ended_at || Date.now() / 1000;
  $("#job-time").textContent = job.started_at ? fmtDuration(end - job.started_at) : "not started";
  drawQueue(job);
  drawDurability(job);
  $("#job-error").hidden = !job.error;
  $("#job-error").textContent = job.error || "";
  const cancel = $("#cancel"), finish = $("#finish");
  if (!cancel.dataset.busy) cancel.disabled = TERMINAL.has(job.state);
  // only a job that trains has a model to keep (the server answers 409 otherwise)
  if (!finish.dataset.busy) finish.disabled = !(TRAINING.has(job.state) || (job.state === "PENDING" && job.step > 0));
  document.title = `${job.name} · ${job.state} · relaytrain`;
}

// A queued job's place and reason; what an admitted job short of slots waits for; an elastic job's
// allotment from the cluster scheduler.
function drawQueue(job) {
  const queued = job.state === "QUEUED";
  $("#job-queue-fact").hidden = !queued;
  const place = $("#job-queue");
  place.textContent = queued ? queueText(job) : "";
  if (queued && job.queue) place.dataset.position = String(job.queue.position);
  else delete place.dataset.position;
  $("#job-waiting-fact").hidden = !job.waiting;  // admitted, short of worker slots
  $("#job-waiting").textContent = job.waiting || "";
  const elastic = Boolean(((job.spec || {}).elastic || {}).enabled);
  const allotted = $("#job-allotted");
  const shown = elastic && job.allotted_workers != null && !TERMINAL.has(job.state);
  allotted.hidden = !shown;
  allotted.textContent = shown ? `allotted ${job.allotted_workers} worker${job.allotted_workers === 1 ? "" : "s"}` : "";
  if (shown) allotted.dataset.workers = String(job.allotted_workers);
  else delete allotted.dataset.workers;
}

// a long path's end (what names the job and the step), cut at a "/" where it can be: "…/job/step-00000040"
function tailPath(path, most) {
  if (path.length <= most) return path;
  const tail = path.slice(-(most - 1)), cut = tail.indexOf("/");
  return "…" + (cut >= 0 && cut < tail.length - 1 ? tail.slice(cut) : tail);
}

// The job's restarts (of its spec's restarts.max) and its newest complete checkpoint: the one
// a restart resumes from when the job's scheduler is lost.
function drawDurability(job) {
  const spec = job.spec || {};
  const most = Number((spec.restarts || {}).max) || 0;
  const used = Number(job.restarts) || 0;
  const restarts = $("#job-restarts");
  restarts.textContent = most ? `${used} / ${most}` : used ? String(used) : "off";
  restarts.classList.toggle("warn", used > 0);
  $("#job-restarts-note").textContent = !most ? "restarts.max is 0"
    : used >= most ? "none left" : `${most - used} left`;

  const every = Number((spec.checkpoint || {}).every_steps) || 0;
  const ck = job.checkpoint;
  const value = $("#job-checkpoint"), where = $("#job-checkpoint-path");
  where.classList.toggle("mono", Boolean(ck && ck.step != null));
  if (ck && ck.step != null) {
    const path = String(ck.path || "");
    value.textContent = `step ${ck.step}`;
    value.dataset.step = String(ck.step);
    where.textContent = tailPath(path, 52);
    where.title = path + (ck.time ? `\nwritten ${new Date(ck.time * 1000).toString()}` : "");
  } else {
    value.textContent = every ? "none yet" : "off";
    delete value.dataset.step;
    where.textContent = every ? `every ${every} steps` : "checkpoint.every_steps is 0";
    where.title = "";
  }
}

async function loadMetrics(v) {
  for (;;) {
    const rows = parseJson(await api(`/v1/jobs/${encodeURIComponent(v.id)}/metrics?after_step=${v.lastStep}&limit=10000`,
                                     { as: "text" }));
    for (const r of rows) v.metrics.push(r);
    if (rows.length) v.lastStep = rows[rows.length - 1].step;
    if (rows.length < 10000) return;
  }
}

async function loadEvents(v) {
  const rows = await api(`/v1/jobs/${encodeURIComponent(v.id)}/events?after=${v.eventsAfter}`);
  if (!rows.length) return;
  v.eventsAfter = rows[rows.length - 1].id;
  const list = $("#events");
  for (const e of rows) {
    v.events.push(e);
    const msg = el("div", { class: "msg" }, e.message);
    if (e.type === "reshape" && e.recovery_s != null) {
      msg.append(el("span", { class: "recovery", text: `recovery ${Number(e.recovery_s).toFixed(2)} s` }));
    }
    if (e.detail) msg.append(el("details", {}, el("summary", { text: "details" }), el("pre", { text: String(e.detail) })));
    const attrs = { "data-type": e.type, "data-id": String(e.id) };
    if (e.recovery_s != null) attrs["data-recovery-s"] = String(e.recovery_s);
    list.append(el("li", attrs, el("span", { class: "when", text: fmtClock(e.time), title: new Date(e.time * 1000).toString() }),
      el("span", { class: "kind " + e.type, text: e.type.replace("_", " ") }), msg));
  }
  list.scrollTop = list.scrollHeight;
}

const OUTPUT_LINES = 500;

async function loadOutput(v) {
  // the newest lines at first, then what came since
  const base = `/v1/jobs/${encodeURIComponent(v.id)}/output?limit=${OUTPUT_LINES}`;
  const rows = await api(v.outputAfter ? `${base}&after=${v.outputAfter}` : `${base}&tail=true`);
  if (v !== view) return;  // another job was opened meanwhile
  const pre = $("#output");
  if (!rows.length) {
    if (!v.output.length) pre.textContent = "Nothing printed yet.";
    return;
  }
  v.outputAfter = rows[rows.length - 1].id;
  for (const o of rows) v.output.push(`${fmtClock(o.time)} [${o.source} ${o.stream}] ${o.line}`);
  v.output.splice(0, Math.max(0, v.output.length - OUTPUT_LINES));
  pre.textContent = v.output.join("\n");
  pre.dataset.lines = String(v.output.length);
  pre.scrollTop = pre.scrollHeight;
}

function drawShape(job) {
  const shape = job.shape || {};
  const body = $("#shape tbody");
  const queued = job.state === "QUEUED";
  $("#shape").hidden = shape.dp == null;
  if (shape.dp == null) {  // a preempted job's row keeps only what it ran as (ran_as)
    $("#shape-summary").textContent = TERMINAL.has(job.state) ? "The job ended before its workers were placed."
      : queued && shape.ran_as ? `The job is queued again and holds no workers: it gave its slots back after ` +
        `step ${job.step} (it ran as dp ${shape.ran_as.dp} × pp ${shape.ran_as.pp}) and ` +
        (job.step ? "resumes from its checkpoint" : "starts from step 0 again") + ` once the cluster scheduler admits it.`
      : queued ? "The job is queued: its workers are placed once the cluster scheduler admits it."
      : "The job has no shape yet (its workers are being placed).";
    body.replaceChildren();
    return;
  }
  const chunks = shapeChunks(shape);
  $("#shape-summary").textContent = `dp ${shape.dp} × pp ${shape.pp}, ${shape.schedule}` +
    (chunks > 1 ? ` (${chunks} model chunks per worker)` : "") +
    (shape.weight_group > 1 ? ` (the W's of ${shape.weight_group} microbatches computed together)` : "") +
    (shape.replicas ? ` (workers per stage ${shape.replicas.join(", ")})` : "") +
    (shape.tp > 1 ? ` × tp ${shape.tp} (each stage's layers split over ${shape.tp} workers)` : "") + ` with ` +
    `${shape.microbatches_per_replica} microbatches per replica, transport ${shape.transport}` +
    (shape.gpus_per_worker ? `, ${shape.gpus_per_worker} GPU per worker` : ", CPU workers");
  const starts = [0];
  for (const n of shape.partition || []) starts.push(starts[starts.length - 1] + n);
  const rows = Object.entries(shape.workers || {}).map(([w, node]) => {
    const [s, rep] = stageOfSlot(Number(w.split(".")[1]), shape.replicas, shape.tp);
    const which = shape.replicas ? `stage ${s} replica ${rep}` : shape.tp > 1 ? `stage ${s} TP rank ${rep}` : `stage ${s}`;
    let layers = which;
    if (shape.partition && chunks === 1) layers = `${which}: layers ${starts[s]}–${starts[s + 1] - 1}`;
    else if (shape.partition) {  // the worker's model chunks (virtual stages), in model order
      const mine = chunksOf(s, shape.pp, chunks, shape.placement || (shape.schedule === "zbv" ? "v" : "loop"));
      layers = `stages ${mine.join(", ")}: layers ` +
        mine.map((vs) => `${starts[vs]}–${starts[vs + 1] - 1}`).join(", ");
    }
    return el("tr", { "data-worker": w, "data-node": node || "" }, el("td", { class: "mono", text: w }),
      el("td", { text: layers }), el("td", { class: "mono", text: node ? node.slice(0, 12) : "?", title: node || "" }));
  });
  body.replaceChildren(...rows);
}

// (stage, replica) of a pipeline's worker `slot` (service/replicas.py stage_of): with replicated
// stages a pipeline's workers are numbered stage by stage; with tensor parallelism (tp > 1) the
// slot is stage x tp + TP rank; else the slot is the stage.
function stageOfSlot(slot, replicas, tp) {
  if (!replicas && tp > 1) return [Math.floor(slot / tp), slot % tp];
  if (!replicas) return [slot, 0];
  for (let s = 0; s < replicas.length; s++) {
    if (slot < replicas[s]) return [s, slot];
    slot -= replicas[s];
  }
  return [slot, 0];
}

// Model chunks per worker (parallelism.stages_per_worker) of a shape: interleaved_1f1b and zbv
// cut the model into pp x chunks virtual stages; the partition lists the layers of each.
function shapeChunks(shape) {
  return Number(shape.chunks || shape.stages_per_worker) ||
    (shape.schedule === "zbv" || shape.schedule === "interleaved_1f1b" ? 2 : 1);
}

// The virtual stages pipeline rank `rank` holds (service/schedules.py chunks_of): "loop" puts
// chunk k on worker k mod pp; zbv's "v" gives worker i the chunks i and 2pp-1-i.
function chunksOf(rank, pp, chunks, where) {
  const out = [];
  for (let vs = 0; vs < pp * chunks; vs++) {
    const k = Math.floor(vs / pp), i = vs % pp;
    if ((where === "v" && k % 2 ? pp - 1 - i : i) === rank) out.push(vs);
  }
  return out;
}

// ------------------------------------------------------------------ the swimlane (rendered by the server)

$("#timeline-step").addEventListener("change", (e) => {
  if (!view || view.kind !== "job") return;
  view.pinned = e.target.value ? Number(e.target.value) : null;
  view.timelineKey = null;
  loadTimeline(view, view.job, generation);
});

async function loadTimeline(v, job, gen) {
  const key = v.pinned != null ? `pin:${v.pinned}` : `${job.step}:${job.state}`;
  if (key === v.timelineKey) return;
  let text;
  try {
    const q = v.pinned != null ? `?step=${v.pinned}` : "";
    text = await api(`/v1/jobs/${encodeURIComponent(v.id)}/timeline.svg${q}`, { as: "text" });
  } catch (e) {
    if (e.status === 404) {
      $("#swimlane").replaceChildren(el("p", { class: "empty", text: job.step ? e.message : "No step measured yet." }));
      v.timelineKey = key;
      return;
    }
    throw e;
  }
  if (gen !== generation) return;
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const root = doc.documentElement;
  if (root.nodeName !== "svg") throw new Error("the timeline is not an SVG");
  const drawn = document.importNode(root, true);
  $("#swimlane").replaceChildren(drawn);
  $("#legend-eval").hidden = markEvalActions(drawn) === 0;
  weightLegend().hidden = markWeightActions(drawn) === 0;
  v.timelineKey = key;
  $("#util-measured").textContent = fmtPct(root.getAttribute("data-utilization"));
  $("#util-plan").textContent = fmtPct(root.getAttribute("data-utilization-plan"));
  const group = Number(root.getAttribute("data-weight-group") || 1);
  $("#util-plan").title = root.getAttribute("data-sends-early")
    ? "the plan with input gradients sent early: each backward sends the gradient of its input before computing its weight gradients (plain Linear layers), so the stage before waits less"
    : root.getAttribute("data-last-sent-early")
    ? "the schedule's plan with each worker's last backward of the step sending its input gradient before its weight gradients (torch's split of that backward: the weights are not in plain Linear layers), backward = 2 x forward"
    : group > 1
    ? `the schedule's plan with its W's in groups of ${group} microbatches, each group where its last W stood (each W box: an equal share of its group's one product), backward = 2 x forward`
    : "the schedule's plan, backward = 2 x forward";
  const steps = (root.getAttribute("data-available") || "").split(" ").filter(Boolean);
  const select = $("#timeline-step");
  const current = select.value;
  select.replaceChildren(el("option", { value: "", text: `latest (${root.getAttribute("data-step")})` }),
    ...steps.reverse().map((s) => el("option", { value: s, text: `step ${s}` })));
  select.value = steps.includes(current) ? current : "";
}

// An evaluation's forwards ("0E5": stage 0, eval forward of eval microbatch 5) follow the step's
// own actions in its timeline: they get their own colour (style.css: rect.action.eval).
function markEvalActions(root) {
  let n = 0;
  for (const box of root.querySelectorAll("rect[data-action]")) {
    const m = /^(\d+)E(\d+)$/.exec(box.getAttribute("data-action"));
    if (!m) continue;
    n += 1;
    box.classList.add("eval");
    const tip = box.querySelector("title");
    // the server may call it a forward or a backward (its colours know F and B only)
    if (tip) tip.textContent = tip.textContent.replace(/\([^()]*microbatch \d+\)/, `(eval forward of eval microbatch ${m[2]})`);
    const label = box.nextElementSibling;
    if (label && label.localName === "text" && label.textContent === m[0]) label.classList.add("eval-label");
  }
  return n;
}

// A split schedule's (zb_h1, zbv) weight gradients ("2W3": stage 2, W of microbatch 3) have their
// own shade, striped (service/timeline.py colour()); its B boxes are the input gradient only.
function markWeightActions(root) {
  let n = 0;
  for (const box of root.querySelectorAll("rect[data-action]")) {
    if (box.getAttribute("data-kind") !== "W" && !/^\d+W\d+$/.test(box.getAttribute("data-action"))) continue;
    n += 1;
    box.classList.add("weight");
  }
  return n;
}

// The legend's W item (after "backward"), made once: shown while the timeline has W boxes.
function weightLegend() {
  let item = $("#legend-weight");
  if (item) return item;
  item = el("span", { class: "legend-item", "data-kind": "W", id: "legend-weight" },
    el("i", { class: "swatch box weight" }), "weight gradient (W)");
  item.hidden = true;
  const legendBox = $("#swimlane-legend");
  const backward = $('[data-kind="B"]', legendBox);
  if (backward) backward.after(item); else legendBox.append(item);
  return item;
}

// ------------------------------------------------------------------ curves

const COLORS = { loss: "#3a62c4", eval: "#dd6b20", speed: "#2f855a", lr: "#6b46c1", grad: "#b7791f",
                 skipped: "#c53030", clip: "#7b8794", restart: "#9c4221" };

function drawCharts(v) {
  const rows = v.metrics;
  // reshapes at their new shape's first step; restarts at the first step they ran again
  const reshapes = [
    ...v.events.filter((e) => e.type === "reshape" && e.step != null),
    ...v.events.filter((e) => e.type === "restarted" && e.from_step != null)
      .map((e) => ({ ...e, step: e.from_step + 1, restarted: true }))];
  const restarts = reshapes.filter((e) => e.restarted).length;
  const skipped = rows.filter((r) => r.skipped).map((r) => r.step);
  const evals = rows.filter((r) => finite(r.eval_loss)).length;
  lineChart($("#loss-curve"), rows, "loss", { color: COLORS.loss, fmt: fmtNum, reshapes, skipped, id: "loss",
    tip: (r) => stepFields(r).map(([, label, text]) => (label ? `${label} ${text}` : text)).join(" · "),
    extra: [{ key: "eval_loss", color: COLORS.eval, attr: "data-eval-step", label: "eval loss" }] });
  legend($("#loss-legend"), [
    { series: "loss", label: "training loss", color: COLORS.loss, mark: "line" },
    evals && { series: "eval_loss", label: `eval loss (${evals})`, color: COLORS.eval, mark: "dot" },
    skipped.length && { series: "skipped", label: `skipped step (${skipped.length})`, color: COLORS.skipped, mark: "skip" },
    restarts && { series: "restart", label: `restart (${restarts})`, color: COLORS.restart, mark: "mark" }]);
  lineChart($("#speed-curve"), rows, "samples_per_s", { color: COLORS.speed, fmt: fmtSpeed, reshapes, id: "speed" });
  // the recipe: the learning rate each step used, the gradient norm before clipping
  const has = (key) => rows.some((r) => key in r);
  $("#lr-card").hidden = !has("lr");
  $("#grad-card").hidden = !has("grad_norm");
  $("#recipe-charts").hidden = !has("lr") && !has("grad_norm");
  if (has("lr")) lineChart($("#lr-curve"), rows, "lr", { color: COLORS.lr, fmt: fmtRate, reshapes, id: "lr" });
  if (has("grad_norm")) {
    const clip = ((v.job && v.job.spec && v.job.spec.training) || {}).grad_clip_norm;
    lineChart($("#grad-curve"), rows, "grad_norm", { color: COLORS.grad, fmt: fmtNum, reshapes, skipped, id: "grad",
      hlines: finite(clip) ? [{ y: clip, label: `clip ${fmtNum(clip)}`, color: COLORS.clip }] : [] });
    legend($("#grad-legend"), [
      finite(clip) && { series: "clip", label: "clip norm", color: COLORS.clip, mark: "dash" },
      skipped.length && { series: "skipped", label: "skipped (not finite)", color: COLORS.skipped, mark: "skip" }]);
  }
  drawStepDetail(v);
}

// [field, label, text] of a step's row: what the readout and the loss chart's tooltips show
function stepFields(r) {
  const out = [["step", "step", String(r.step)], ["loss", "loss", fmtNum(r.loss)]];
  if ("eval_loss" in r) out.push(["eval_loss", "eval loss", fmtNum(r.eval_loss)]);
  if ("lr" in r) out.push(["lr", "lr", fmtRate(r.lr)]);
  if ("grad_norm" in r) out.push(["grad_norm", "grad norm", finite(r.grad_norm) ? fmtNum(r.grad_norm)
    : r.skipped || r.grad_norm != null ? "not finite" : "–"]);
  if (r.skipped) out.push(["skipped", "skipped:", "its gradient was not finite"]);
  if (r.rerun) out.push(["rerun", "", "re-run"]);
  return out;
}

// the step readout above the charts: the newest step, or the one the mouse is over in a chart
function nearestRow(rows, step) {
  let lo = 0, hi = rows.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (rows[mid].step < step) lo = mid + 1; else hi = mid;
  }
  return lo > 0 && step - rows[lo - 1].step < rows[lo].step - step ? rows[lo - 1] : rows[lo];
}

function drawStepDetail(v) {
  const box = $("#step-detail");
  box.hidden = !v.metrics.length;
  if (!v.metrics.length) return;
  const r = v.detailStep == null ? v.metrics[v.metrics.length - 1] : nearestRow(v.metrics, v.detailStep);
  box.dataset.step = String(r.step);
  box.classList.toggle("skipped", Boolean(r.skipped));
  box.replaceChildren(...stepFields(r).map(([field, label, text]) =>
    el("span", { class: "field", "data-field": field }, label ? el("span", { class: "muted", text: label + " " }) : null,
       el("b", { text }))),
  el("span", { class: "muted hint", text: v.detailStep == null ? "newest step; point at a chart for another" : "" }));
}

for (const id of ["#loss-curve", "#speed-curve", "#lr-curve", "#grad-curve"]) {
  const box = $(id);
  box.addEventListener("mousemove", (e) => {
    const scale = box.scale, v = view;
    if (!scale || !v || v.kind !== "job" || !v.metrics.length) return;
    const rect = box.firstChild.getBoundingClientRect();
    const vx = ((e.clientX - rect.left) * scale.W) / rect.width;
    const step = Math.round(scale.step(vx));
    if (step === v.detailStep) return;
    v.detailStep = step;
    scale.guide(nearestRow(v.metrics, step).step);
    drawStepDetail(v);
  });
  box.addEventListener("mouseleave", () => {
    if (box.scale) box.scale.guide(null);
    if (view && view.kind === "job") { view.detailStep = null; drawStepDetail(view); }
  });
}

function legend(box, items) {
  box.replaceChildren(...items.filter(Boolean).map((it) => {
    const swatch = el("i", { class: "swatch " + it.mark });
    swatch.style.color = it.color;  // the swatch draws in currentColor (CSSOM: allowed by the page's CSP)
    return el("span", { class: "legend-item", "data-series": it.series }, swatch, it.label);
  }));
}

function niceTicks(lo, hi, n = 5) {
  if (hi === lo) { hi = lo + (Math.abs(lo) || 1) * 0.1; lo = lo - (Math.abs(lo) || 1) * 0.1; }
  const raw = (hi - lo) / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((k) => k * mag).find((s) => s >= raw) || 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return { lo: Math.min(lo, ticks[0]), hi: Math.max(hi, ticks[ticks.length - 1]), ticks };
}

const MAX_MARKERS = 5000;  // a marker per step up to this many; beyond, the line only

// rows' `key` over steps: a point per finite value, the line broken where a step has none (null,
// NaN, Infinity); `extra` series (points on the steps that have them, joined), `skipped` steps
// and reshapes (restarts among them) as vertical marks, `hlines` as dashed horizontal ones
function lineChart(box, rows, key, { color, fmt, reshapes = [], skipped = [], id, extra = [], hlines = [], tip }) {
  const pts = rows.filter((r) => finite(r[key]));
  box.scale = null;
  if (!pts.length) {
    box.replaceChildren(el("p", { class: "empty", text: rows.length ? "Not finite on any step yet." : "No committed step yet." }));
    return;
  }
  const series = extra.map((s) => ({ ...s, pts: rows.filter((r) => finite(r[s.key])) }));
  const W = 560, H = 240, L = 58, R = 14, T = 12, B = 34;
  const x0 = rows[0].step, x1 = Math.max(rows[rows.length - 1].step, x0 + 1);
  const values = [...pts.map((p) => p[key]), ...series.flatMap((s) => s.pts.map((p) => p[s.key])), ...hlines.map((h) => h.y)];
  const ys = niceTicks(Math.min(...values), Math.max(...values));
  const X = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - R);
  const Y = (y) => T + (1 - (y - ys.lo) / (ys.hi - ys.lo)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: `${id}-svg`, "data-points": String(pts.length),
                            "font-family": "system-ui, sans-serif", role: "img", "aria-label": `${key} over steps` });
  for (const t of ys.ticks) {
    root.append(svg("line", { x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#eceff3" }));
    root.append(svg("text", { x: L - 8, y: Y(t) + 4, "text-anchor": "end", "font-size": 11, fill: "#7b8794" }, fmt(t)));
  }
  const xs = niceTicks(x0, x1, 6);
  for (const t of xs.ticks.filter((t) => t >= x0 && t <= x1 && Number.isInteger(t))) {
    root.append(svg("text", { x: X(t), y: H - B + 16, "text-anchor": "middle", "font-size": 11, fill: "#7b8794" }, String(t)));
  }
  root.append(svg("text", { x: W - R, y: H - 4, "text-anchor": "end", "font-size": 11, fill: "#7b8794" }, "step"));
  for (const e of reshapes) {
    if (e.step < x0 || e.step > x1) continue;
    const g = svg("g", { [e.restarted ? "data-restart" : "data-reshape"]: String(e.step) });
    g.append(svg("line", { x1: X(e.step), x2: X(e.step), y1: T, y2: H - B, "stroke-dasharray": "4 3",
                           stroke: e.restarted ? COLORS.restart : "#6b46c1", "stroke-width": e.restarted ? 1.6 : 1 }));
    g.append(svg("title", {}, e.restarted ? `restart ${e.restart} at step ${e.step}: ${e.message}` : `step ${e.step}: ${e.message}`));
    root.append(g);
  }
  for (const s of skipped) {
    if (s < x0 || s > x1) continue;
    const g = svg("g", { class: "skipped-mark", "data-skipped": String(s) });
    g.append(svg("line", { x1: X(s), x2: X(s), y1: T, y2: H - B, stroke: COLORS.skipped, "stroke-opacity": 0.55 }));
    g.append(svg("path", { d: `M${X(s) - 4},${T - 4} l8,8 m0,-8 l-8,8`, stroke: COLORS.skipped, "stroke-width": 2 }));
    g.append(svg("title", {}, `step ${s} skipped: its gradient was not finite`));
    root.append(g);
  }
  for (const h of hlines) {
    const g = svg("g", { class: "hline", "data-hline": String(h.y) });
    g.append(svg("line", { x1: L, x2: W - R, y1: Y(h.y), y2: Y(h.y), stroke: h.color, "stroke-dasharray": "6 4" }));
    g.append(svg("text", { x: W - R - 2, y: Y(h.y) - 4, "text-anchor": "end", "font-size": 11, fill: h.color }, h.label));
    root.append(g);
  }
  let run = [];  // the line's runs of consecutive finite values
  const flush = () => {
    if (run.length > 1) root.append(svg("polyline", { points: run.join(" "), fill: "none", stroke: color, "stroke-width": 1.8,
                                                       "stroke-linejoin": "round", "data-series": key }));
    run = [];
  };
  for (const r of rows) {
    if (finite(r[key])) run.push(`${X(r.step).toFixed(1)},${Y(r[key]).toFixed(1)}`); else flush();
  }
  flush();
  const skip = new Set(skipped);
  if (pts.length <= MAX_MARKERS) {
    const r = pts.length > 1000 ? 1.2 : pts.length > 150 ? 1.8 : 2.6;
    for (const p of pts) {
      const marked = skip.has(p.step);
      const c = svg("circle", { cx: X(p.step).toFixed(1), cy: Y(p[key]).toFixed(1), r: marked ? Math.max(r, 3.5) : r,
                                fill: marked ? "#ffffff" : color, stroke: marked ? COLORS.skipped : "none",
                                "stroke-width": marked ? 2 : 0, class: marked ? "point skipped" : "point",
                                "data-step": String(p.step) });
      c.append(svg("title", {}, tip ? tip(p) : `step ${p.step}: ${fmt(p[key])}${p.rerun ? " (re-run)" : ""}`));
      root.append(c);
    }
  }
  for (const s of series) {  // drawn over the main series: they have few points
    if (!s.pts.length) continue;
    root.append(svg("polyline", { points: s.pts.map((p) => `${X(p.step).toFixed(1)},${Y(p[s.key]).toFixed(1)}`).join(" "),
                                  fill: "none", stroke: s.color, "stroke-width": 1.6, "stroke-dasharray": "5 3",
                                  "data-series": s.key }));
    for (const p of s.pts) {
      const c = svg("circle", { cx: X(p.step).toFixed(1), cy: Y(p[s.key]).toFixed(1), r: 3.6, fill: s.color,
                                stroke: "#ffffff", "stroke-width": 1.2, class: "point", [s.attr]: String(p.step) });
      c.append(svg("title", {}, `step ${p.step}: ${s.label} ${fmt(p[s.key])}`));
      root.append(c);
    }
  }
  root.setAttribute("data-series-points", series.map((s) => `${s.key}:${s.pts.length}`).join(" "));
  const guide = svg("line", { class: "hover-guide", x1: 0, x2: 0, y1: T, y2: H - B, stroke: "#9aa5b1", visibility: "hidden" });
  root.append(guide);
  box.replaceChildren(root);
  box.scale = {
    W, step: (vx) => x0 + ((vx - L) / (W - L - R)) * (x1 - x0),
    guide: (s) => {
      if (s == null) { guide.setAttribute("visibility", "hidden"); return; }
      guide.setAttribute("x1", X(s).toFixed(1)); guide.setAttribute("x2", X(s).toFixed(1));
      guide.setAttribute("visibility", "visible");
    },
  };
}

// ------------------------------------------------------------------ cancel, finish now

// A button that POSTs the job's `action` once the user confirms (`question(job)`), saying `busy` meanwhile.
function jobAction(id, action, question, busy, failed) {
  const button = $(id);
  const label = button.textContent;
  button.addEventListener("click", async () => {
    const v = view;
    if (!v || v.kind !== "job" || !v.job) return;
    if (!confirm(question(v.job))) return;
    button.disabled = true;
    button.dataset.busy = "1";
    button.textContent = busy;
    try {
      await api(`/v1/jobs/${encodeURIComponent(v.id)}/${action}`, { method: "POST" });
    } catch (e) {
      if (e.status !== 401) showBanner(`${failed}: ${e.message}`);
    } finally {
      delete button.dataset.busy;
      button.textContent = label;
    }
    if (view === v) { stop(); refreshJob(generation); }
  });
}

jobAction("#cancel", "cancel", (job) => `Cancel job ${job.id}? ` +
  (job.state === "QUEUED" ? "It leaves the queue." : "It stops at its next step boundary."),
  "Cancelling…", "Could not cancel");
jobAction("#finish", "finish", (job) => `Finish job ${job.id} now? It ends after the step under way and keeps ` +
  "its model as trained so far (SUCCEEDED).", "Finishing…", "Could not finish");

route();
