/* pagedserve dashboard: the engine's step records, the KV cache and a chat playground.
 *
 * Plain JS, no dependencies. Sections:
 *   1. state (window.dashboard) and small helpers
 *   2. API access: the key, fetch with "Authorization: Bearer", an SSE reader on fetch()
 *   3. step records: the stream, back-filling the steps the stream's decimation dropped,
 *      and folding each record into request lives and time series
 *   4. drawing: the step timeline, the KV grid, the small charts, the request life
 *   5. the chat playground
 *   6. tabs, events, start-up
 */
"use strict";
(function () {

// ---------------------------------------------------------------- 1. state and helpers

const TIMELINE_STEPS = 300;          // columns kept in the step timeline
const WINDOW_S = 300;                // the small charts cover the last 5 minutes
const KV_POLL_MS = 1000;
const BACKFILL_MS = 1000;            // how often to fetch the steps the stream dropped
const BACKFILL_MAX = 512;            // at most this many records per back-fill
const MAX_LIVES = 4000;              // request lives kept (finished ones are pruned first)
const KEY_STORAGE = "pagedserveApiKey";
const PAGE_PARAMS = new URLSearchParams(location.search);

const dashboard = window.dashboard = {
  stepsSeen: 0,        // records received (each step once)
  lastStep: null,      // the newest record
  preemptions: 0,      // preempted ids seen, in total
  kv: null,            // the last /v1/dashboard/kv_cache snapshot
  requests: {},        // engine request id -> life
  showRequest: (id) => showRequest(id),
  selectTab: (name) => selectTab(name),
};

const state = {
  seenSteps: new Set(),    // step indices received (recent ones), to drop duplicates and find gaps
  carriedSteps: new Set(), // steps seen only as a carried record (see section 3)
  liveStep: null,          // the last step the stream sent
  floorStep: null,         // no back-fill below this step
  timeline: new Map(),     // step -> record, the last TIMELINE_STEPS steps
  series: [],              // [{t, step, running, waiting, used, cachedFree, total, samples}] sorted by step
  clockOffset: 0,          // server time - browser time, from live records
  selected: null,          // request id shown in the life panel
  lifeShown: null,         // "id/version" last rendered, to skip identical re-renders
  timelineHits: [],        // for hover/click: [{x0, x1, step, record, segs: [{y0, y1, id}]}]
  timelineGeom: null,
  kvIndex: null,           // {ownerOf: [], cols, cell, n}
  stream: null,            // AbortController of the step stream
  streamDisabled: false,   // 404: records are off
  needKey: false,
  kvBusy: false,
  backfillBusy: false,
};

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const serverNow = () => Date.now() / 1000 + state.clockOffset;

function fmtClock(t) {
  if (t == null) return "–";
  const d = new Date(t * 1000);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

function fmtSeconds(s) {
  if (s == null || !isFinite(s)) return "–";
  return s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms` : `${s.toFixed(2)} s`;
}

function quantile(sorted, q) {
  if (!sorted.length) return null;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))));
  return sorted[i];
}

/** A stable colour per request id (FNV-1a hash -> hue). */
const colourCache = new Map();
function requestColour(id) {
  let c = colourCache.get(id);
  if (!c) {
    let h = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 0x01000193) >>> 0; }
    c = `hsl(${h % 360}, ${55 + (h >>> 9) % 30}%, ${45 + (h >>> 17) % 15}%)`;
    if (colourCache.size > 20000) colourCache.clear();
    colourCache.set(id, c);
  }
  return c;
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

let COLOURS = null;   // read from the CSS once the page is loaded
function loadColours() {
  COLOURS = {};
  for (const name of ["prefill", "decode", "budget", "preempt", "finish", "null-block", "cached-free", "free",
    "running", "waiting", "used", "muted", "line", "ink", "accent"]) COLOURS[name] = cssVar(`--${name}`);
}

// ---------------------------------------------------------------- 2. API access

function apiKey() {
  // sessionStorage, not localStorage: the key is gone with the tab, and no other page of the origin
  // opened later (e.g. /docs, which loads scripts from a CDN) can read it.
  try { return sessionStorage.getItem(KEY_STORAGE) || ""; } catch (e) { return ""; }
}

function setApiKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key); else sessionStorage.removeItem(KEY_STORAGE);
  } catch (e) { /* storage off: the key lives in the field only */ }
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey() || $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

/** fetch() with the API key; a 401 shows the key field. */
async function apiFetch(path, options = {}) {
  const resp = await fetch(path, Object.assign({}, options, { headers: authHeaders(options.headers) }));
  if (resp.status === 401) showKeyNeeded(true);
  return resp;
}

/** The message of OpenAI's error JSON, or the body's text. */
async function errorMessage(resp) {
  const text = await resp.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    if (body && body.error) return `${resp.status}: ${body.error.message || JSON.stringify(body.error)}`;
    if (body && body.detail) return `${resp.status}: ${typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail)}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status} ${resp.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
}

function showKeyNeeded(needed) {
  state.needKey = needed;
  $("api-key").parentElement.classList.toggle("needed", needed);
  if (needed) setStatus("API key needed: enter it at the top right", true);
}

/** Reads a server-sent-events body, calling onData(text) per event's data. Throwing stops it. */
async function readSSE(body, onData) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  const line = (text) => {
    if (text.endsWith("\r")) text = text.slice(0, -1);
    if (text === "") {
      if (data.length) { const event = data.join("\n"); data = []; onData(event); }
    } else if (text.startsWith("data:")) {
      data.push(text.slice(text.startsWith("data: ") ? 6 : 5));
    }   // comments (":...") and other fields are ignored
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) { line(buffer.slice(0, nl)); buffer = buffer.slice(nl + 1); }
    }
    if (buffer) line(buffer);
    line("");
  } finally {
    reader.cancel().catch(() => {});
  }
}

function setStatus(text, isError) {
  const el = $("status");
  el.textContent = text;
  el.classList.toggle("error", !!isError);
}

// ---------------------------------------------------------------- 3. step records
//
// The stream is decimated (at most max_rate records a second): a record sent after skipped ones
// carries their preemptions and finishes. Such a record is "carried": its preemptions and finishes
// are provisional, known only to lie in (the previous streamed step, its step]. Once a second the
// page fetches the skipped records (/v1/dashboard/steps/recent?since=...) and each provisional
// event is matched with its exact step, so nothing is counted twice and lives are complete.

function streamQuery() {
  const q = new URLSearchParams();
  q.set("history", PAGE_PARAMS.get("history") || String(TIMELINE_STEPS));
  for (const name of ["max_rate", "every_step"]) if (PAGE_PARAMS.has(name)) q.set(name, PAGE_PARAMS.get(name));
  // No "since" on a reconnect: a restarted server counts steps from 0 again. The history's records
  // already seen are dropped (ingest), and a step that goes back in time resets the view.
  return q.toString();
}

/** Follows /v1/dashboard/steps, reconnecting after errors (not after a 401 or 404). */
async function streamSteps() {
  if (state.stream) state.stream.abort();
  const controller = state.stream = new AbortController();
  let retry = true;
  try {
    const resp = await apiFetch(`/v1/dashboard/steps?${streamQuery()}`, { signal: controller.signal });
    if (resp.status === 401) { retry = false; return; }
    if (resp.status === 404) { retry = false; recordsOff(); return; }
    if (!resp.ok) throw new Error(await errorMessage(resp));
    showKeyNeeded(false);
    setStatus("live");
    state.liveStep = dashboard.lastStep ? dashboard.lastStep.step : null;
    await readSSE(resp.body, (data) => onLiveRecord(JSON.parse(data)));
    setStatus("stream ended: reconnecting…", true);
  } catch (e) {
    if (controller.signal.aborted) { retry = false; return; }
    setStatus(`step stream: ${e.message}; reconnecting…`, true);
  } finally {
    if (retry && state.stream === controller) setTimeout(() => { if (state.stream === controller) streamSteps(); }, 2000);
  }
}

function recordsOff() {
  state.streamDisabled = true;
  const banner = $("engine-banner");
  banner.hidden = false;
  banner.textContent = "Step records are off on this server (--step-record-buffer-size 0): the engine view is empty.";
  setStatus("step records off", true);
}

function allSeen(from, to) {
  for (let s = from; s <= to; s++) if (!state.seenSteps.has(s)) return false;
  return true;
}

function onLiveRecord(record) {
  if (!dashboard.lastStep || record.step >= dashboard.lastStep.step) {
    state.clockOffset = record.time - Date.now() / 1000;
  }
  const prev = state.liveStep;
  const carriedFrom = prev != null && record.step > prev + 1 && !allSeen(prev + 1, record.step - 1) ? prev + 1 : null;
  if (prev == null || record.step > prev) state.liveStep = record.step;
  if (ingest(record, carriedFrom)) scheduleDraw();
}

/** Folds one record in; false if it brought nothing new. carriedFrom: see the section's comment. */
function ingest(record, carriedFrom = null) {
  const last = dashboard.lastStep;
  if (last && record.step < last.step - 1 && record.time > last.time + 1) resetRecords();   // the server restarted
  if (state.seenSteps.has(record.step)) {
    if (carriedFrom == null && state.carriedSteps.has(record.step)) { upgradeCarried(record); return true; }
    return false;
  }
  state.seenSteps.add(record.step);
  if (state.floorStep == null) state.floorStep = record.step;   // no back-fill before the first record
  dashboard.stepsSeen++;
  if (!dashboard.lastStep || record.step > dashboard.lastStep.step) dashboard.lastStep = record;
  for (const r of record.requests || []) noteScheduled(record, r);
  const range = carriedFrom == null ? [record.step, record.step] : [carriedFrom, record.step];
  if (carriedFrom != null) state.carriedSteps.add(record.step);
  noteEvents(record, range);
  addToTimeline(record);
  addToSeries(record);
  return true;
}

function noteEvents(record, range) {
  for (const id of record.preempted || []) notePreempted(record, id, range);
  for (const f of record.finished || []) noteFinished(record, f, range);
}

/** The exact record of a step first seen carried: its events pin down provisional ones. */
function upgradeCarried(record) {
  state.carriedSteps.delete(record.step);
  noteEvents(record, [record.step, record.step]);
  if (state.timeline.has(record.step)) state.timeline.set(record.step, record);
  if (dashboard.lastStep && dashboard.lastStep.step === record.step) dashboard.lastStep = record;
}

function resetRecords() {
  state.seenSteps.clear();
  state.carriedSteps.clear();
  state.timeline.clear();
  state.series = [];
  state.floorStep = null;
  state.liveStep = null;
  dashboard.lastStep = null;
  dashboard.requests = {};
}

function lifeOf(id) {
  let life = dashboard.requests[id];
  if (!life) {
    life = dashboard.requests[id] = {
      id, arrival: null, promptTokens: null, cachedTokens: null,
      steps: [],              // [{step, time, kind, phase, tokens, computed, blocks, samples}] by step
      preemptedAt: [],        // [{step, time, lo, hi, exact, claimed}]: in (lo..hi), at step when exact
      firstTokenTime: null,   // time of the first step that sampled for it
      finish: null,           // {step, time, reason, outputTokens, lo, hi, exact}
      lastTime: 0, version: 0,
    };
  }
  return life;
}

function insertByStep(list, item) {
  let i = list.length;
  while (i > 0 && list[i - 1].step > item.step) i--;
  list.splice(i, 0, item);
}

function touch(life, time) {
  life.version++;
  if (time > life.lastTime) life.lastTime = time;
}

function noteScheduled(record, r) {
  const life = lifeOf(r.id);
  insertByStep(life.steps, {
    step: record.step, time: record.time, kind: r.kind, phase: r.phase, tokens: r.tokens,
    computed: r.computed, blocks: r.blocks, samples: !!r.samples,
  });
  if (r.prompt_tokens != null) life.promptTokens = r.prompt_tokens;
  if (r.kind === "new") {
    if (r.arrival_time != null) life.arrival = r.arrival_time;
    life.cachedTokens = r.cached_tokens || 0;
  }
  if (r.samples && (life.firstTokenTime == null || record.time < life.firstTokenTime)) life.firstTokenTime = record.time;
  touch(life, record.time);
}

/** A preemption, counted once: an exact one claims a provisional one whose range holds it, and back. */
function notePreempted(record, id, [lo, hi]) {
  const life = lifeOf(id);
  const events = life.preemptedAt;
  if (lo === hi) {
    if (events.some((e) => e.exact && e.step === lo)) return;
    const provisional = events.find((e) => !e.exact && e.lo <= lo && lo <= e.hi);
    if (provisional) {
      Object.assign(provisional, { step: lo, time: record.time, lo, hi, exact: true, claimed: true });
      events.sort((a, b) => a.step - b.step);
      touch(life, record.time);
      return;
    }
  } else {
    const exact = events.find((e) => e.exact && !e.claimed && lo <= e.step && e.step <= hi);
    if (exact) { exact.claimed = true; return; }
  }
  dashboard.preemptions++;
  insertByStep(events, { step: hi, time: record.time, lo, hi, exact: lo === hi, claimed: false });
  touch(life, record.time);
}

/** A finish: an exact one replaces a provisional one; a provisional one never replaces anything. */
function noteFinished(record, f, [lo, hi]) {
  const life = lifeOf(f.id);
  const old = life.finish;
  if (old && (old.exact || lo !== hi)) return;
  life.finish = { step: hi, time: record.time, reason: f.reason, outputTokens: f.output_tokens, lo, hi, exact: lo === hi };
  touch(life, record.time);
}

function addToTimeline(record) {
  state.timeline.set(record.step, record);
  const newest = dashboard.lastStep.step;
  if (state.timeline.size > TIMELINE_STEPS * 1.2) {
    for (const step of state.timeline.keys()) if (step <= newest - TIMELINE_STEPS) state.timeline.delete(step);
  }
}

function addToSeries(record) {
  const kv = record.kv_blocks || {};
  const point = {
    t: record.time, step: record.step, running: record.num_running, waiting: record.num_waiting,
    used: kv.used, cachedFree: kv.cached_free, total: kv.total,
    // new_tokens: 1 + accepted drafts under speculative decoding; samples alone would count 1.
    samples: (record.requests || []).reduce((n, r) => n + (r.new_tokens ?? (r.samples ? 1 : 0)), 0),
  };
  insertByStep(state.series, point);
  const cutoff = dashboard.lastStep.time - WINDOW_S - 5;
  let drop = 0;
  while (drop < state.series.length && state.series[drop].t < cutoff) drop++;
  if (drop) state.series.splice(0, drop);
}

/** The lowest step between the floor and the newest one that no record covered, or null. */
function lowestMissingStep() {
  const last = dashboard.lastStep;
  if (!last || state.floorStep == null) return null;
  const from = Math.max(state.floorStep, last.step - 4 * BACKFILL_MAX);
  for (let s = from; s < last.step; s++) if (!state.seenSteps.has(s)) return s;
  return null;
}

/** Fetches the records the decimated stream left out, so lives, TTFT and throughput are exact. */
async function backfill() {
  if (state.backfillBusy || state.streamDisabled || state.needKey || PAGE_PARAMS.get("backfill") === "0") return;
  const missing = lowestMissingStep();
  if (missing == null) return;
  state.backfillBusy = true;
  try {
    const resp = await apiFetch(`/v1/dashboard/steps/recent?since=${missing - 1}&limit=${BACKFILL_MAX}`);
    if (!resp.ok) return;
    const records = await resp.json();
    if (!Array.isArray(records)) return;
    let added = false;
    for (const record of records) added = ingest(record) || added;
    // What is still missing up to the newest record returned is not in the server's buffer (any
    // more, or it answered the newest BACKFILL_MAX): never ask for it again.
    const reached = records.length ? records[records.length - 1].step : dashboard.lastStep.step;
    state.floorStep = Math.max(state.floorStep, reached);
    if (added) scheduleDraw();
  } catch (e) {
    /* the next tick tries again */
  } finally {
    state.backfillBusy = false;
    pruneSteps();
  }
}

function pruneSteps() {
  if (!dashboard.lastStep || state.seenSteps.size < 16384) return;
  const keep = dashboard.lastStep.step - 8192;
  for (const s of state.seenSteps) if (s < keep) state.seenSteps.delete(s);
  for (const s of state.carriedSteps) if (s < keep) state.carriedSteps.delete(s);
  state.floorStep = Math.max(state.floorStep, keep);
}

function pruneLives() {
  const ids = Object.keys(dashboard.requests);
  if (ids.length <= MAX_LIVES) return;
  const lives = ids.map((id) => dashboard.requests[id]).filter((l) => l.finish && l.id !== state.selected);
  lives.sort((a, b) => a.lastTime - b.lastTime);
  for (const life of lives.slice(0, ids.length - MAX_LIVES)) delete dashboard.requests[life.id];
}

// ---------------------------------------------------------------- KV snapshots

async function pollKv() {
  // Each snapshot scans the whole cache on the engine thread: only when someone can see it.
  if (state.kvBusy || state.streamDisabled || state.needKey) return;
  if (!engineVisible() || document.visibilityState === "hidden") return;
  state.kvBusy = true;
  try {
    const resp = await apiFetch("/v1/dashboard/kv_cache");
    if (resp.status === 404) { recordsOff(); return; }
    if (!resp.ok) return;
    dashboard.kv = await resp.json();
    indexKv();
    drawKv();
  } catch (e) {
    /* the next poll tries again */
  } finally {
    state.kvBusy = false;
  }
}

/** Block -> owner (first owner for shared blocks), kept with the snapshot. */
function indexKv() {
  const kv = dashboard.kv;
  const ownerOf = new Array(kv.num_blocks).fill(null);
  for (const [id, blocks] of Object.entries(kv.owners || {})) {
    for (const b of blocks) if (b < ownerOf.length && ownerOf[b] == null) ownerOf[b] = id;
  }
  state.kvIndex = Object.assign(state.kvIndex || {}, { ownerOf, n: kv.num_blocks });
}

function ownersOfBlock(block) {
  const owners = [];
  for (const [id, blocks] of Object.entries((dashboard.kv && dashboard.kv.owners) || {})) {
    if (blocks.includes(block)) owners.push(id);
  }
  return owners;
}

// ---------------------------------------------------------------- 4. drawing

/** Sizes a canvas to its CSS width and the given CSS height (backing store in device pixels);
 * returns its cleared context, scaled to CSS pixels, and its size. */
function prepCanvas(canvas, height) {
  const width = canvas.clientWidth;
  if (!width) return null;
  const dpr = window.devicePixelRatio || 1;
  height = height || canvas.clientHeight || Number(canvas.getAttribute("height")) || 120;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w: width, h: height };
}

let drawPending = false;
function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; drawTimeline(); renderStepStats(); });
}

function engineVisible() { return !$("panel-engine").hidden; }

// ---- the step timeline

function timelineScale(geom, tokens) {
  const f = geom.sqrt ? Math.sqrt : (x) => x;
  return geom.bottom - (f(Math.max(0, tokens)) / f(geom.yMax)) * (geom.bottom - geom.top);
}

function timelineGeometry(w, h, newest) {
  const first = newest - TIMELINE_STEPS + 1;
  let yMax = 1;
  for (const record of state.timeline.values()) {
    yMax = Math.max(yMax, record.max_num_batched_tokens || 0, record.num_scheduled_tokens || 0);
  }
  const left = 46, right = 6, top = 8;
  return {
    first, newest, left, top, bottom: h - 44, w, h,
    colW: (w - left - right) / TIMELINE_STEPS,
    yMax: yMax * 1.04, sqrt: $("timeline-scale").value === "sqrt",
    byRequest: $("timeline-colour").value === "request",
  };
}

function drawTimeline() {
  if (!engineVisible()) return;
  const canvas = $("timeline");
  const c = prepCanvas(canvas, 260);
  if (!c) return;
  const { ctx, w, h } = c;
  state.timelineHits = [];
  const last = dashboard.lastStep;
  if (!last) { drawEmpty(ctx, w, h, "waiting for engine steps…"); return; }
  const geom = state.timelineGeom = timelineGeometry(w, h, last.step);
  drawTimelineAxes(ctx, geom);
  for (let step = geom.first; step <= geom.newest; step++) {
    const record = state.timeline.get(step);
    if (record) drawTimelineColumn(ctx, geom, record);
  }
  drawBudgetLine(ctx, geom);
}

function drawTimelineColumn(ctx, geom, record) {
  const x0 = geom.left + (record.step - geom.first) * geom.colW;
  const width = Math.max(1, geom.colW - (geom.colW >= 4 ? 1 : 0));
  const hit = { x0, x1: x0 + geom.colW, step: record.step, record, segs: [] };
  let run = null;   // thin neighbours of one colour are filled as one rectangle
  const flush = () => { if (run) ctx.fillRect(x0, run.yHigh, width, Math.max(1, run.yLow - run.yHigh - run.gap)); run = null; };
  let cum = 0;
  for (const r of record.requests || []) {
    const yLow = timelineScale(geom, cum), yHigh = timelineScale(geom, cum + r.tokens);
    cum += r.tokens;
    hit.segs.push({ y0: yHigh, y1: yLow, id: r.id });
    const selected = state.selected === r.id;
    const colour = geom.byRequest || selected ? requestColour(r.id) : (r.phase === "prefill" ? COLOURS.prefill : COLOURS.decode);
    const thin = yLow - yHigh < 3;
    if (run && run.colour === colour && thin && !selected) { run.yHigh = yHigh; continue; }
    flush();
    ctx.fillStyle = colour;
    run = { colour, yLow, yHigh, gap: thin ? 0 : 1 };
    if (selected) { flush(); outlineSegment(ctx, x0, width, yLow, yHigh); }
  }
  flush();
  drawMarkers(ctx, geom, record, x0, width);
  state.timelineHits.push(hit);
}

function outlineSegment(ctx, x0, width, yLow, yHigh) {
  ctx.strokeStyle = COLOURS.ink;
  ctx.lineWidth = 1;
  ctx.strokeRect(x0 + 0.5, yHigh + 0.5, Math.max(1, width - 1), Math.max(1, yLow - yHigh - 1));
}

function drawMarkers(ctx, geom, record, x0, width) {
  const cx = x0 + width / 2, size = Math.max(3, Math.min(6, geom.colW));
  if ((record.preempted || []).length) {
    const y = geom.bottom + 4;
    ctx.fillStyle = COLOURS.preempt;
    ctx.beginPath();
    ctx.moveTo(cx - size, y); ctx.lineTo(cx + size, y); ctx.lineTo(cx, y + size * 1.6);
    ctx.closePath(); ctx.fill();
  }
  if ((record.finished || []).length) {
    const y = geom.bottom + 18;
    ctx.fillStyle = COLOURS.finish;
    ctx.beginPath();
    ctx.arc(cx, y, Math.max(2, size * 0.7), 0, 2 * Math.PI);
    ctx.fill();
  }
}

function drawBudgetLine(ctx, geom) {
  ctx.strokeStyle = COLOURS.budget;
  ctx.lineWidth = 1.5;
  ctx.setLineDash([6, 3]);
  ctx.beginPath();
  let started = false;
  for (const hit of state.timelineHits) {
    const y = timelineScale(geom, hit.record.max_num_batched_tokens);
    if (!started) { ctx.moveTo(geom.left, y); started = true; }
    ctx.lineTo(hit.x1, y);
  }
  if (started) ctx.lineTo(geom.w - 6, timelineScale(geom, dashboard.lastStep.max_num_batched_tokens));
  ctx.stroke();
  ctx.setLineDash([]);
}

function drawTimelineAxes(ctx, geom) {
  ctx.strokeStyle = COLOURS.line;
  ctx.fillStyle = COLOURS.muted;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const budget = dashboard.lastStep.max_num_batched_tokens || geom.yMax;
  const ticks = geom.sqrt ? [0, budget / 64, budget / 16, budget / 4, budget] : [0, budget / 4, budget / 2, budget * 3 / 4, budget];
  for (const t of ticks) {
    const y = Math.round(timelineScale(geom, t)) + 0.5;
    ctx.beginPath(); ctx.moveTo(geom.left, y); ctx.lineTo(geom.w - 6, y); ctx.stroke();
    ctx.fillText(String(Math.round(t)), geom.left - 4, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let s = Math.ceil(geom.first / 50) * 50; s <= geom.newest; s += 50) {
    if (s < 0) continue;
    ctx.fillText(String(s), geom.left + (s - geom.first + 0.5) * geom.colW, geom.h - 12);
  }
  ctx.textAlign = "left";
  ctx.fillText("step", 4, geom.h - 12);
}

function drawEmpty(ctx, w, h, text) {
  ctx.fillStyle = COLOURS.muted;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  ctx.fillText(text, w / 2, h / 2);
}

function timelineHitAt(x, y) {
  const hit = state.timelineHits.find((c) => x >= c.x0 && x < c.x1);
  if (!hit) return null;
  const seg = hit.segs.find((s) => y >= s.y0 - 1 && y <= s.y1 + 1);
  let id = seg ? seg.id : null;
  const geom = state.timelineGeom;
  const preempted = hit.record.preempted || [], finished = hit.record.finished || [];
  if (!id && y > geom.bottom && y < geom.bottom + 12 && preempted.length) id = preempted[0];
  if (!id && y >= geom.bottom + 12 && y < geom.bottom + 26 && finished.length) id = finished[0].id;
  return { hit, id };
}

function describeStep(record) {
  const d = record.duration_ms || {};
  const lines = [
    `step ${record.step} · ${fmtClock(record.time)}`,
    `${record.num_scheduled_tokens} / ${record.max_num_batched_tokens} tokens · ${(record.requests || []).length} requests`,
    `running ${record.num_running} · waiting ${record.num_waiting}`,
    `${(d.total || 0).toFixed(1)} ms (schedule ${(d.schedule || 0).toFixed(1)}, forward ${(d.forward || 0).toFixed(1)}, sample ${(d.sample || 0).toFixed(1)}, update ${(d.update || 0).toFixed(1)})`,
  ];
  if ((record.preempted || []).length) lines.push(`preempted: ${record.preempted.join(", ")}`);
  for (const f of record.finished || []) lines.push(`finished: ${f.id} (${f.reason}, ${f.output_tokens ?? "?"} tokens)`);
  return lines;
}

function timelineTooltip(x, y) {
  const found = timelineHitAt(x, y);
  if (!found) return null;
  const lines = describeStep(found.hit.record);
  if (found.id) {
    const r = (found.hit.record.requests || []).find((q) => q.id === found.id);
    if (r) lines.unshift(`${r.id}: ${r.kind}, ${r.phase} ${r.tokens} tokens (computed ${r.computed}/${r.prompt_tokens} prompt, ${r.blocks} blocks)${r.samples ? ", samples" : ""}`, "");
  }
  return lines.join("\n");
}

// ---- the KV grid

function kvLayout(w, n) {
  let cell = 16;
  while (cell > 3 && Math.ceil(n / Math.floor(w / cell)) * cell > 420) cell--;
  const cols = Math.max(1, Math.floor(w / cell));
  return { cell, cols, rows: Math.ceil(n / cols) };
}

function drawKv() {
  if (!engineVisible()) return;
  const kv = dashboard.kv;
  const canvas = $("kv-grid");
  if (!kv) { const c = prepCanvas(canvas, 60); if (c) drawEmpty(c.ctx, c.w, c.h, "waiting for a KV snapshot…"); return; }
  const width = canvas.clientWidth;
  if (!width) return;
  const layout = kvLayout(width, kv.num_blocks);
  const c = prepCanvas(canvas, Math.max(20, layout.rows * layout.cell));
  Object.assign(state.kvIndex, layout);
  const selectedBlocks = new Set((kv.owners || {})[state.selected] || []);
  for (let b = 0; b < kv.num_blocks; b++) drawKvBlock(c.ctx, b, layout, selectedBlocks);
  renderKvSummary();
}

function kvBlockColour(b) {
  const st = dashboard.kv.states[b];
  if (st === "N") return COLOURS["null-block"];
  if (st === "C") return COLOURS["cached-free"];
  if (st === "F") return COLOURS.free;
  const owner = state.kvIndex.ownerOf[b];
  return owner ? requestColour(owner) : COLOURS.used;
}

function drawKvBlock(ctx, b, layout, selectedBlocks) {
  const { cell, cols } = layout;
  const x = (b % cols) * cell, y = Math.floor(b / cols) * cell;
  const inner = cell >= 6 ? cell - 1 : cell;
  ctx.globalAlpha = selectedBlocks.size && dashboard.kv.states[b] === "U" && !selectedBlocks.has(b) ? 0.3 : 1;
  ctx.fillStyle = kvBlockColour(b);
  ctx.fillRect(x, y, inner, inner);
  ctx.globalAlpha = 1;
  const shared = dashboard.kv.shared && dashboard.kv.shared[String(b)];
  if (shared || selectedBlocks.has(b)) {
    const lw = cell >= 10 ? 2 : 1;
    ctx.lineWidth = lw;
    ctx.strokeStyle = selectedBlocks.has(b) && !shared ? COLOURS.accent : COLOURS.ink;
    ctx.strokeRect(x + lw / 2, y + lw / 2, inner - lw, inner - lw);
  }
}

function renderKvSummary() {
  const kv = dashboard.kv;
  const counts = { N: 0, U: 0, C: 0, F: 0 };
  for (const ch of kv.states) counts[ch] = (counts[ch] || 0) + 1;
  $("kv-summary").textContent = `step ${kv.step} · ${kv.num_blocks} blocks of ${kv.block_size} tokens · ` +
    `${counts.U} used, ${counts.C} cached+free, ${counts.F} free · ${Object.keys(kv.owners || {}).length} requests · ` +
    `${Object.keys(kv.shared || {}).length} shared`;
}

function kvBlockAt(x, y) {
  const idx = state.kvIndex;
  if (!idx || !idx.cell || !dashboard.kv) return null;
  const col = Math.floor(x / idx.cell), row = Math.floor(y / idx.cell);
  if (col >= idx.cols) return null;
  const b = row * idx.cols + col;
  return b < dashboard.kv.num_blocks ? b : null;
}

function kvTooltip(x, y) {
  const b = kvBlockAt(x, y);
  if (b == null) return null;
  const names = { N: "null block", U: "in use", C: "cached, free (evictable)", F: "free" };
  const lines = [`block ${b}: ${names[dashboard.kv.states[b]] || dashboard.kv.states[b]}`];
  const refs = dashboard.kv.shared && dashboard.kv.shared[String(b)];
  if (refs) lines.push(`shared by ${refs} requests`);
  for (const id of ownersOfBlock(b)) lines.push(id);
  return lines.join("\n");
}

// ---- small charts

function chartFrame(canvas) {
  const c = prepCanvas(canvas, 120);
  if (!c) return null;
  const t1 = dashboard.lastStep ? Math.max(serverNow(), dashboard.lastStep.time) : serverNow();
  return Object.assign(c, { left: 36, top: 6, bottom: c.h - 16, right: c.w - 4, t0: t1 - WINDOW_S, t1 });
}

function chartAxes(f, yMax, yLabel) {
  const { ctx } = f;
  ctx.strokeStyle = COLOURS.line;
  ctx.fillStyle = COLOURS.muted;
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(f.left, f.top + 0.5); ctx.lineTo(f.right, f.top + 0.5);
  ctx.moveTo(f.left, f.bottom + 0.5); ctx.lineTo(f.right, f.bottom + 0.5);
  ctx.stroke();
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  ctx.fillText(yLabel || String(Math.round(yMax)), f.left - 4, f.top + 4);
  ctx.fillText("0", f.left - 4, f.bottom);
}

function timeAxis(f) {
  const { ctx } = f;
  ctx.textBaseline = "top"; ctx.textAlign = "center";
  for (let m = 0; m * 60 <= WINDOW_S; m++) {
    const x = f.right - (m * 60 / WINDOW_S) * (f.right - f.left);
    ctx.textAlign = m ? "center" : "right";
    ctx.fillText(m ? `-${m}m` : "now", m ? x : f.right, f.bottom + 3);
  }
}

/** Step-wise lines of [t, v] points over the time window. */
function drawLines(f, lines, yMax) {
  const { ctx } = f;
  const xOf = (t) => f.left + ((t - f.t0) / (f.t1 - f.t0)) * (f.right - f.left);
  const yOf = (v) => f.bottom - (v / yMax) * (f.bottom - f.top);
  for (const line of lines) {
    ctx.strokeStyle = line.colour;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let prevY = null;
    for (const [t, v] of line.points) {
      if (t < f.t0) continue;
      const x = xOf(t), y = yOf(v);
      if (prevY == null) ctx.moveTo(x, y); else { ctx.lineTo(x, prevY); ctx.lineTo(x, y); }
      prevY = y;
    }
    if (prevY != null && line.extend !== false) ctx.lineTo(f.right, prevY);
    ctx.stroke();
  }
}

function drawQueues() {
  const f = chartFrame($("chart-queues"));
  if (!f) return;
  const pts = state.series;
  const yMax = pts.reduce((m, p) => Math.max(m, p.running, p.waiting), 1);
  chartAxes(f, yMax);
  timeAxis(f);
  drawLines(f, [
    { colour: COLOURS.waiting, points: pts.map((p) => [p.t, p.waiting]) },
    { colour: COLOURS.running, points: pts.map((p) => [p.t, p.running]) },
  ], yMax);
}

function drawKvSeries() {
  const f = chartFrame($("chart-kv"));
  if (!f) return;
  const pts = state.series.filter((p) => p.used != null);
  const yMax = pts.reduce((m, p) => Math.max(m, p.total || 0), 1);
  chartAxes(f, yMax);
  timeAxis(f);
  drawLines(f, [
    { colour: COLOURS["cached-free"], points: pts.map((p) => [p.t, p.cachedFree]) },
    { colour: COLOURS.used, points: pts.map((p) => [p.t, p.used]) },
  ], yMax);
}

/** Output tokens per second, in one-second buckets: a step sampling for a request is one token. */
function throughputBuckets(t0, t1) {
  const n = Math.ceil(t1 - t0);
  const buckets = new Array(n).fill(0);
  for (const p of state.series) {
    const i = Math.floor(p.t - t0);
    if (i >= 0 && i < n) buckets[i] += p.samples;
  }
  return buckets;
}

function drawThroughput() {
  const f = chartFrame($("chart-throughput"));
  if (!f) return;
  const t1 = Math.floor(f.t1);
  const buckets = throughputBuckets(t1 - WINDOW_S, t1);
  const recent = buckets.slice(-6, -1);   // the last full seconds
  $("throughput-now").textContent = `${Math.round(recent.reduce((a, b) => a + b, 0) / Math.max(1, recent.length))}`;
  const yMax = buckets.reduce((m, v) => Math.max(m, v), 1);
  chartAxes(f, yMax);
  timeAxis(f);
  const w = (f.right - f.left) / buckets.length;
  f.ctx.fillStyle = COLOURS.decode;
  buckets.forEach((v, i) => {
    if (!v) return;
    const hgt = (v / yMax) * (f.bottom - f.top);
    f.ctx.fillRect(f.left + i * w, f.bottom - hgt, Math.max(1, w - 0.5), hgt);
  });
}

/** TTFT and TPOT (seconds) of the requests whose first token / finish is in the window. */
function latencySamples() {
  const since = (dashboard.lastStep ? Math.max(serverNow(), dashboard.lastStep.time) : serverNow()) - WINDOW_S;
  const ttft = [], tpot = [];
  for (const life of Object.values(dashboard.requests)) {
    if (life.arrival != null && life.firstTokenTime != null && life.firstTokenTime >= since) {
      ttft.push(life.firstTokenTime - life.arrival);
    }
    const f = life.finish;
    if (f && f.time >= since && life.firstTokenTime != null && f.outputTokens > 1) {
      tpot.push((f.time - life.firstTokenTime) / (f.outputTokens - 1));
    }
  }
  return { ttft: ttft.sort((a, b) => a - b), tpot: tpot.sort((a, b) => a - b) };
}

function drawHistogram(canvas, sorted, colour, summaryEl) {
  summaryEl.textContent = sorted.length
    ? `n=${sorted.length} · p50 ${fmtSeconds(quantile(sorted, 0.5))} · p90 ${fmtSeconds(quantile(sorted, 0.9))} · p99 ${fmtSeconds(quantile(sorted, 0.99))}`
    : "no requests yet";
  const f = chartFrame(canvas);
  if (!f) return;
  if (!sorted.length) { drawEmpty(f.ctx, f.w, f.h, "–"); return; }
  const xMax = Math.max(1e-4, quantile(sorted, 0.99) * 1.1), nBins = 30;
  const bins = new Array(nBins).fill(0);
  for (const v of sorted) bins[Math.min(nBins - 1, Math.floor((v / xMax) * nBins))]++;
  const yMax = Math.max(...bins);
  chartAxes(f, yMax);
  const w = (f.right - f.left) / nBins;
  f.ctx.fillStyle = colour;
  bins.forEach((v, i) => {
    const hgt = (v / yMax) * (f.bottom - f.top);
    if (v) f.ctx.fillRect(f.left + i * w, f.bottom - hgt, Math.max(1, w - 1), hgt);
  });
  drawQuantileMarks(f, sorted, xMax);
}

function drawQuantileMarks(f, sorted, xMax) {
  const { ctx } = f;
  ctx.fillStyle = COLOURS.muted;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText("0", f.left, f.bottom + 3);
  ctx.textAlign = "right";
  ctx.fillText(fmtSeconds(xMax), f.right, f.bottom + 3);
  ctx.strokeStyle = COLOURS.ink;
  ctx.setLineDash([2, 2]);
  [0.5, 0.9].forEach((q, row) => {
    const x = f.left + (quantile(sorted, q) / xMax) * (f.right - f.left);
    const y = f.top + row * 11;
    ctx.beginPath(); ctx.moveTo(x, y + 2); ctx.lineTo(x, f.bottom); ctx.stroke();
    const right = x > f.right - 30;
    ctx.textAlign = right ? "right" : "left";
    ctx.fillText(`p${q * 100}`, x + (right ? -3 : 3), y);
  });
  ctx.setLineDash([]);
}

function renderHitRate() {
  const since = (dashboard.lastStep ? dashboard.lastStep.time : serverNow()) - WINDOW_S;
  let cached = 0, prompt = 0, n = 0;
  for (const life of Object.values(dashboard.requests)) {
    if (life.arrival == null || life.arrival < since || !life.promptTokens || life.cachedTokens == null) continue;
    cached += life.cachedTokens; prompt += life.promptTokens; n++;
  }
  $("prefix-hit-rate").textContent = prompt ? `${(100 * cached / prompt).toFixed(1)} %` : "–";
  $("prefix-hit-detail").textContent = n
    ? `${cached} of ${prompt} prompt tokens from the prefix cache, over ${n} new requests`
    : "no new requests in the window";
}

function renderStepStats() {
  const r = dashboard.lastStep;
  if (!r || !engineVisible()) return;
  const kv = r.kv_blocks || {};
  const d = r.duration_ms || {};
  const item = (label, value) => `<span>${label} <b>${esc(value)}</b></span>`;
  $("step-stats").innerHTML = [
    item("step", r.step), item("at", fmtClock(r.time)),
    item("tokens", `${r.num_scheduled_tokens} / ${r.max_num_batched_tokens}`),
    item("running", r.num_running), item("waiting", r.num_waiting),
    item("KV used", `${kv.used} / ${kv.total}`), item("step time", `${(d.total || 0).toFixed(1)} ms`),
    item("records", dashboard.stepsSeen), item("preemptions", dashboard.preemptions),
  ].join("");
  if (!state.needKey && !state.streamDisabled) setStatus(`live · step ${r.step}`);
}

function renderPanels() {
  if (!engineVisible()) return;
  drawQueues();
  drawThroughput();
  drawKvSeries();
  const { ttft, tpot } = latencySamples();
  drawHistogram($("chart-ttft"), ttft, COLOURS.prefill, $("ttft-summary"));
  drawHistogram($("chart-tpot"), tpot, COLOURS.decode, $("tpot-summary"));
  renderHitRate();
  renderRecent();
  renderLife();
}

// ---- request lives

function showRequest(id) {
  state.selected = id;
  state.lifeShown = null;
  renderLife();
  drawTimeline();
  drawKv();
}

function lifeRows(life) {
  const rows = life.steps.map((s) => ({ step: s.step, html: stepRow(life, s) }));
  for (const p of life.preemptedAt) {
    const where = p.exact ? "" : ` (in steps ${p.lo}–${p.hi})`;
    rows.push({ step: p.step + 0.5, html: `<tr class="preempt"><td>${p.step}</td><td>${relTime(life, p.time)}</td><td colspan="5">preempted${where}</td></tr>` });
  }
  if (life.finish) {
    const f = life.finish;
    const where = f.exact ? "" : ` (in steps ${f.lo}–${f.hi})`;
    rows.push({ step: f.step + 0.6, html: `<tr class="finish"><td>${f.step}</td><td>${relTime(life, f.time)}</td><td colspan="5">finished: ${esc(f.reason)}, ${f.outputTokens ?? "?"} output tokens${where}</td></tr>` });
  }
  rows.sort((a, b) => a.step - b.step);
  if (rows.length <= 400) return rows.map((r) => r.html).join("");
  const hidden = rows.length - 400;
  return rows.slice(0, 100).map((r) => r.html).join("") +
    `<tr><td colspan="7" class="muted">… ${hidden} more rows …</td></tr>` + rows.slice(-300).map((r) => r.html).join("");
}

function relTime(life, t) {
  return life.arrival != null ? `+${fmtSeconds(t - life.arrival)}` : fmtClock(t);
}

function stepRow(life, s) {
  return `<tr><td>${s.step}</td><td>${relTime(life, s.time)}</td><td>${esc(s.kind)}</td>` +
    `<td class="${s.phase === "prefill" ? "prefill" : "decode"}">${esc(s.phase)}</td><td>${s.tokens}</td>` +
    `<td>${s.blocks}</td><td>${s.samples ? "✓" : ""}</td></tr>`;
}

function lifeSummary(life) {
  const f = life.finish;
  const ttft = life.arrival != null && life.firstTokenTime != null ? life.firstTokenTime - life.arrival : null;
  const tpot = f && life.firstTokenTime != null && f.outputTokens > 1 ? (f.time - life.firstTokenTime) / (f.outputTokens - 1) : null;
  const prefill = life.steps.filter((s) => s.phase === "prefill").reduce((n, s) => n + s.tokens, 0);
  const decodes = life.steps.filter((s) => s.phase === "decode").length;
  const kvBlocks = dashboard.kv && dashboard.kv.owners ? (dashboard.kv.owners[life.id] || []).length : null;
  const pairs = [
    ["arrival", fmtClock(life.arrival)], ["prompt tokens", life.promptTokens ?? "–"],
    ["prefix-cached", life.cachedTokens ?? "–"], ["TTFT", fmtSeconds(ttft)], ["TPOT", fmtSeconds(tpot)],
    ["steps seen", `${life.steps.length} (${prefill} prefill tokens, ${decodes} decodes)`],
    ["preemptions", life.preemptedAt.length],
    ["finish", f ? `${f.reason} at step ${f.step}, ${f.outputTokens ?? "?"} output tokens` : "running"],
  ];
  if (kvBlocks != null) pairs.push(["KV blocks now", kvBlocks]);
  return pairs.map(([k, v]) => `<dt>${k}</dt><dd>${esc(v)}</dd>`).join("");
}

function renderLife() {
  const el = $("request-life");
  if (!state.selected) return;
  if (!dashboard.requests[state.selected]) {
    const choices = engineIdsOf(state.selected);   // an API id: show its first choice
    if (choices.length) state.selected = choices[0];
  }
  const id = state.selected;
  const life = dashboard.requests[id];
  const blocks = dashboard.kv && dashboard.kv.owners ? (dashboard.kv.owners[id] || []).length : -1;
  const key = `${id}/${life ? life.version : -1}/${blocks}`;
  if (state.lifeShown === key) return;
  state.lifeShown = key;
  const head = `<h4><span class="swatch" style="background:${requestColour(id)}"></span>${esc(id)}</h4>`;
  if (!life) {
    el.innerHTML = head + `<p class="muted">No step record of this request yet (it may not have run, or its steps are older than the server's buffer).</p>`;
    return;
  }
  el.innerHTML = head + `<dl>${lifeSummary(life)}</dl>` +
    `<table><thead><tr><th>step</th><th>time</th><th>kind</th><th>phase</th><th title="tokens scheduled">tok</th><th title="KV blocks held">blk</th><th title="sampled a token">out</th></tr></thead>` +
    `<tbody>${lifeRows(life)}</tbody></table>`;
}

function renderRecent() {
  const lives = Object.values(dashboard.requests).sort((a, b) => b.lastTime - a.lastTime).slice(0, 40);
  $("recent-requests").innerHTML = lives.map((life) => {
    const status = life.finish ? life.finish.reason : (life.preemptedAt.length ? "running, preempted" : "running");
    return `<li data-request="${esc(life.id)}"><span class="swatch" style="background:${requestColour(life.id)}"></span>` +
      `${esc(life.id)} <span class="muted">${esc(status)}</span></li>`;
  }).join("");
}

// ---- tooltips

function showTooltip(event, text) {
  const tip = $("tooltip");
  if (!text) { tip.hidden = true; return; }
  tip.textContent = text;
  tip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = event.clientY + 14 + tip.offsetHeight > window.innerHeight ? event.clientY - tip.offsetHeight - 8 : event.clientY + 14;
  tip.style.left = `${x}px`;
  tip.style.top = `${y}px`;
}

function canvasPoint(canvas, event) {
  const rect = canvas.getBoundingClientRect();
  return [event.clientX - rect.left, event.clientY - rect.top];
}

// ---------------------------------------------------------------- 5. chat

const chat = { messages: [], controller: null };

async function loadModels() {
  try {
    const resp = await apiFetch("/v1/models");
    if (!resp.ok) return;
    const body = await resp.json();
    const select = $("chat-model");
    select.innerHTML = (body.data || []).map((m) => `<option>${esc(m.id)}</option>`).join("");
  } catch (e) { /* the send will show the error */ }
}

function numberField(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = parse(raw);
  return Number.isFinite(v) ? v : undefined;
}

function chatBody(messages) {
  const body = {
    model: $("chat-model").value || undefined,
    messages, stream: true, stream_options: { include_usage: true },
    temperature: numberField("chat-temperature", parseFloat),
    top_p: numberField("chat-top-p", parseFloat),
    max_tokens: numberField("chat-max-tokens", (s) => parseInt(s, 10)),
    seed: numberField("chat-seed", (s) => parseInt(s, 10)),
  };
  if ($("chat-logprobs").checked) body.logprobs = true;
  return body;
}

function chatMessages(userText) {
  const system = $("chat-system").value.trim();
  const messages = system ? [{ role: "system", content: system }] : [];
  return messages.concat(chat.messages, [{ role: "user", content: userText }]);
}

function appendChat(cls, text) {
  const el = document.createElement("div");
  el.className = cls;
  if (text) el.textContent = text;
  $("chat-log").appendChild(el);
  scrollChat();
  return el;
}

function scrollChat() {
  const log = $("chat-log");
  log.scrollTop = log.scrollHeight;
}

function probabilityColour(p) {
  return `hsla(${Math.round(120 * p)}, 85%, 50%, 0.35)`;
}

/** Appends a delta: one span per token when logprobs cover it exactly, else one span for the delta. */
function appendDelta(el, content, logprobs) {
  const tokens = logprobs && logprobs.content ? logprobs.content : null;
  if (!tokens || !tokens.length) { el.appendChild(document.createTextNode(content)); return; }
  const pieces = tokens.map((t) => t.token).join("") === content ? tokens.map((t) => [t.token, [t]]) : [[content, tokens]];
  for (const [text, toks] of pieces) {
    const span = document.createElement("span");
    const logp = toks.reduce((s, t) => s + t.logprob, 0);
    span.className = "tok";
    span.textContent = text;
    span.style.background = probabilityColour(Math.exp(logp));
    span.title = toks.map((t) => `${JSON.stringify(t.token)}: p=${Math.exp(t.logprob).toFixed(3)} (logprob ${t.logprob.toFixed(3)})` +
      (t.top_logprobs || []).map((a) => `\n  ${JSON.stringify(a.token)}: ${Math.exp(a.logprob).toFixed(3)}`).join("")).join("\n");
    el.appendChild(span);
  }
}

/** The engine ids of an API id: the id itself (one choice) or "<id>-<i>" per choice. */
function engineIdsOf(apiId) {
  const ids = Object.keys(dashboard.requests).filter((rid) => rid === apiId || rid.startsWith(`${apiId}-`));
  return ids.sort();
}

function showChatRequestId(id) {
  const el = $("chat-request-id");
  if (!id) { el.textContent = "–"; delete el.dataset.id; return; }
  const engineIds = engineIdsOf(id);
  const links = engineIds.length > 1
    ? engineIds.map((rid) => `<a href="#engine" data-request="${esc(rid)}">${esc(rid)} →</a>`).join(" ")
    : `<a href="#engine" data-request="${esc(id)}">${esc(id)} →</a>`;
  el.innerHTML = links;
  el.dataset.id = id;
}

/** Shows, in the Engine tab, the life of the reply with this API id (its first choice). */
function openChatRequest(apiId) {
  selectTab("engine");
  showRequest(apiId);   // renderLife() picks "<id>-0" when the engine's id has the choice suffix
}

function setChatBusy(busy) {
  $("chat-send").disabled = busy;
  $("chat-stop").disabled = !busy;
}

async function sendChat() {
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || chat.controller) return;
  input.value = "";
  const userEl = appendChat("user", text);
  const messages = chatMessages(text);
  const replyEl = appendChat("assistant streaming", "");
  chat.controller = new AbortController();
  setChatBusy(true);
  const reply = { text: "", finish: null, usage: null, id: null };
  try {
    await streamChat(messages, replyEl, reply, chat.controller.signal);
    chat.messages.push({ role: "user", content: text }, { role: "assistant", content: reply.text });
    chatMeta(reply);
  } catch (e) {
    chatFailed(e, reply, text, userEl, replyEl, chat.controller.signal.aborted);
  } finally {
    chat.controller = null;
    replyEl.classList.remove("streaming");
    setChatBusy(false);
    if (reply.id) showChatRequestId(reply.id);
    scrollChat();
  }
}

async function streamChat(messages, replyEl, reply, signal) {
  const resp = await apiFetch("/v1/chat/completions", {
    method: "POST", signal, headers: { "Content-Type": "application/json" }, body: JSON.stringify(chatBody(messages)),
  });
  if (!resp.ok) throw new Error(await errorMessage(resp));
  await readSSE(resp.body, (data) => {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.id && !reply.id) { reply.id = chunk.id; showChatRequestId(chunk.id); }
    if (chunk.usage) reply.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      if (choice.index !== 0) continue;
      const content = (choice.delta && choice.delta.content) || "";
      if (content) { reply.text += content; appendDelta(replyEl, content, choice.logprobs); scrollChat(); }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
    }
  });
}

function chatMeta(reply) {
  const parts = [];
  if (reply.finish) parts.push(`finish: ${reply.finish}`);
  if (reply.usage) parts.push(`${reply.usage.prompt_tokens} prompt + ${reply.usage.completion_tokens} completion tokens`);
  const meta = appendChat("meta", parts.join(" · "));
  if (reply.id) {
    meta.append(parts.length ? " · " : "");
    const link = document.createElement("a");
    link.href = "#engine";
    link.dataset.request = reply.id;
    link.textContent = `${reply.id} →`;
    meta.appendChild(link);
  }
}

function chatFailed(error, reply, text, userEl, replyEl, aborted) {
  if (aborted) {
    if (reply.text) chat.messages.push({ role: "user", content: text }, { role: "assistant", content: reply.text });
    appendChat("meta", "stopped");
    return;
  }
  if (!reply.text) {
    replyEl.remove();
    userEl.classList.add("failed");
    if (!$("chat-input").value) $("chat-input").value = text;   // to retry
  }
  appendChat("error", error.message);
}

function clearChat() {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  $("chat-log").innerHTML = "";
  showChatRequestId(null);
}

// ---------------------------------------------------------------- 6. tabs, events, start-up

function selectTab(name) {
  for (const tab of ["engine", "chat"]) {
    const active = tab === name;
    $(`tab-${tab}`).classList.toggle("active", active);
    $(`tab-${tab}`).setAttribute("aria-selected", String(active));
    $(`panel-${tab}`).hidden = !active;
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  if (name === "engine") redrawAll();
  else $("chat-input").focus();
}

function redrawAll() {
  drawTimeline();
  renderStepStats();
  drawKv();
  renderPanels();
}

function onKeyEntered() {
  const key = $("api-key").value.trim();
  setApiKey(key);
  showKeyNeeded(false);
  state.streamDisabled = false;
  $("engine-banner").hidden = true;
  streamSteps();
  pollKv();
  loadModels();
}

function bindEngineEvents() {
  const timeline = $("timeline"), grid = $("kv-grid");
  timeline.addEventListener("mousemove", (e) => showTooltip(e, timelineTooltip(...canvasPoint(timeline, e))));
  timeline.addEventListener("mouseleave", (e) => showTooltip(e, null));
  timeline.addEventListener("click", (e) => {
    const found = timelineHitAt(...canvasPoint(timeline, e));
    if (found && found.id) showRequest(found.id);
  });
  grid.addEventListener("mousemove", (e) => showTooltip(e, kvTooltip(...canvasPoint(grid, e))));
  grid.addEventListener("mouseleave", (e) => showTooltip(e, null));
  grid.addEventListener("click", (e) => {
    const b = kvBlockAt(...canvasPoint(grid, e));
    const owners = b == null ? [] : ownersOfBlock(b);
    if (owners.length) showRequest(owners[0]);
  });
  $("recent-requests").addEventListener("click", (e) => {
    const li = e.target.closest("li[data-request]");
    if (li) showRequest(li.dataset.request);
  });
  for (const id of ["timeline-colour", "timeline-scale"]) $(id).addEventListener("change", drawTimeline);
}

function bindChatEvents() {
  $("chat-send").addEventListener("click", sendChat);
  $("chat-stop").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
  $("chat-clear").addEventListener("click", clearChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); sendChat(); }
  });
  for (const id of ["chat-request-id", "chat-log"]) {
    $(id).addEventListener("click", (e) => {
      const a = e.target.closest("a[data-request]");
      if (!a) return;
      e.preventDefault();
      openChatRequest(a.dataset.request);
    });
  }
}

function bindEvents() {
  $("tab-engine").addEventListener("click", () => selectTab("engine"));
  $("tab-chat").addEventListener("click", () => selectTab("chat"));
  const key = $("api-key");
  key.value = apiKey();
  key.addEventListener("change", onKeyEntered);
  key.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); onKeyEntered(); } });
  bindEngineEvents();
  bindChatEvents();
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(redrawAll, 150); });
}

function start() {
  loadColours();
  bindEvents();
  $("window-minutes").textContent = String(WINDOW_S / 60);
  selectTab(location.hash === "#chat" ? "chat" : "engine");
  streamSteps();
  pollKv();
  loadModels();
  setInterval(pollKv, KV_POLL_MS);
  setInterval(backfill, BACKFILL_MS);
  setInterval(() => { pruneLives(); pruneSteps(); renderPanels(); }, 1000);
  redrawAll();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();

})();
