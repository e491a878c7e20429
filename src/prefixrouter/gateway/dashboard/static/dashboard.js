// prefixrouter dashboard: reads /dashboard/events (server-sent events, a snapshot a second)
// and draws it with plain DOM and SVG. No libraries, nothing fetched from elsewhere.
// Every string from the gateway goes through textContent (request ids and model names come
// from clients).
"use strict";

(function () {
  const HITS = ["warm", "partial", "cold"];
  const KEEP_DECISIONS = 200;
  const state = { cls: "*", history: [], latest: null, decisions: [], selected: null, key: null };

  // -- small DOM helpers --------------------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }
  const SVG = "http://www.w3.org/2000/svg";
  function sv(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (typeof v !== "number") return String(v);
    const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 2) : digits;
    return v.toLocaleString("en-US", { maximumFractionDigits: d, minimumFractionDigits: 0 });
  }
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
  const ratio = (a, b) => (b ? a / b : null);
  const mean = (pair) => (pair && pair[1] ? pair[0] / pair[1] : null);

  // -- the key: from the fragment (#key=...), session storage, or the form ---------------------
  // The fragment holds the key alone, URL-encoded (dashboard_url): all of it after "key=" is
  // the key, so one typed by hand with a bare "&" is not cut short there.
  let keyProblem = "";
  function initKey() {
    const m = /(?:^|[#&])key=(.*)$/.exec(location.hash);
    if (m) {
      // Out of the address bar and the history first, whether or not it can be read.
      history.replaceState(null, "", location.pathname + location.search);
      try {
        state.key = decodeURIComponent(m[1]);
        sessionStorage.setItem("prefixrouter-key", state.key);
      } catch (e) {  // URIError: a "%" not followed by two hex digits
        state.key = null;
        keyProblem = "the key in the address is not URL-encoded (a % must be written %25): type it here";
      }
    } else {
      state.key = sessionStorage.getItem("prefixrouter-key");
    }
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      keyProblem = "";
      state.key = $("key").value;
      sessionStorage.setItem("prefixrouter-key", state.key);
      $("key-form").hidden = true;
      connect();
    });
  }

  // -- the stream: fetch (so the key goes in a header) and parse the events -------------------
  let generation = 0;
  async function connect() {
    const mine = ++generation;
    setStatus("connecting", "connecting");
    const headers = { Accept: "text/event-stream" };
    if (state.key) headers.Authorization = "Bearer " + state.key;
    let resp;
    try {
      resp = await fetch("/dashboard/events", { headers, cache: "no-store" });
    } catch (e) {
      return retry(mine, "gateway unreachable");
    }
    if (resp.status === 403) {
      // No admin key is configured: no key opens the data, so no form; say how to turn it on.
      let said = "";
      try { said = ((await resp.json()).error || {}).message || ""; } catch (e) { /* not JSON */ }
      setStatus("error", "dashboard off");
      $("key-form").hidden = true;
      $("off-detail").textContent = said || "HTTP 403";
      $("off").hidden = false;
      return;
    }
    if (resp.status === 401) {
      setStatus("error", "admin key needed");
      $("key-form").hidden = false;
      $("key-error").textContent = state.key ? "that key was refused" : keyProblem;
      return;
    }
    if (!resp.ok) return retry(mine, "HTTP " + resp.status);
    setStatus("live", "live");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done || mine !== generation) break;
        buf += decoder.decode(value, { stream: true });
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          handleEvent(buf.slice(0, end));
          buf = buf.slice(end + 2);
        }
      }
    } catch (e) { /* connection lost */ }
    retry(mine, "disconnected");
  }
  function retry(mine, why) {
    if (mine !== generation) return;
    setStatus("error", why + ", retrying");
    setTimeout(() => { if (mine === generation) connect(); }, 2000);
  }
  function setStatus(kind, text) {
    const s = $("status");
    s.className = "status " + kind;
    s.textContent = text;
  }
  function handleEvent(raw) {
    let name = "message", data = "";
    for (const line of raw.split("\n")) {
      if (line.startsWith("event:")) name = line.slice(6).trim();
      else if (line.startsWith("data:")) data += line.slice(5).trim();
    }
    if (!data) return;
    const msg = JSON.parse(data);
    if (name === "hello") {
      state.history = msg.history || [];
      state.decisions = [];
      addDecisions(msg.recent || []);
    } else {
      state.history.push(msg.point);
      if (state.history.length > 120) state.history.shift();
      addDecisions(msg.decisions || []);
    }
    state.latest = msg;
    render();
  }
  function addDecisions(list) {
    for (const d of list) state.decisions.unshift(d);
    if (state.decisions.length > KEEP_DECISIONS) state.decisions.length = KEEP_DECISIONS;
  }

  // -- rendering ---------------------------------------------------------------------------
  function render() {
    const s = state.latest;
    if (!s) return;
    const g = s.gateway;
    $("gateway-info").textContent =
      `policy ${g.policy} · ${g.mode} mode` + (g.replica ? ` · replica ${g.replica}` : "") +
      ` · up ${fmt(g.uptime_s, 0)} s · ${g.subscribers} viewer(s)`;
    syncClasses(s.classes);
    const cls = state.cls;
    const win = s.window.classes[cls] || null;
    const all = s.window.classes["*"];
    $("t-decisions").textContent = fmt(g.decisions_per_s);
    $("t-requests").textContent = fmt(g.requests, 0);
    $("t-cached").textContent = win ? pct(ratio(win.cached, win.cached + win.uncached)) : "–";
    const pt = (s.point.classes || {})[cls];
    $("t-cached-rate").textContent = pt ? fmt(pt.cached_per_s, 0) : "0";
    $("t-abandoned").textContent = win ? pct(ratio(win.abandoned, win.n)) : "–";
    $("t-evictions").textContent = fmt(s.window.evictions.observed, 0);
    const unrouted = s.window.unrouted;
    $("t-unrouted").textContent = unrouted ? fmt(unrouted.total, 0) : "–";
    $("t-unrouted-by").textContent = unrouted
      ? Object.entries(unrouted.by_status).map(([st, n]) => `${st} ×${fmt(n, 0)}`).join(" · ")
      : "";
    renderDrift(s.drift);
    $("sampling").textContent =
      `This second: ${g.decisions_made} decisions finished, ${g.decisions_seen} counted, ` +
      `${g.decisions_shown} sent (at most 12 a second, evenly spaced: every k-th when more ` +
      `finish). Figures count every decision while fewer than the decision log's ring ` +
      `holds finish in a second, then the newest ring-full, with rates scaled.`;
    renderWorkers(s.workers);
    renderCharts();
    renderBars(win, s.window.evictions);
    renderClasses(s.window.classes, s.classes);
    renderCluster(s.cluster);
    renderDecisions();
  }

  function syncClasses(classes) {
    const sel = $("class");
    const have = new Set([...sel.options].map((o) => o.value));
    for (const c of classes) if (!have.has(c)) sel.append(el("option", { value: c }, c));
  }

  function renderDrift(d) {
    const badge = $("drift-badge");
    $("t-drift").textContent = d.state;
    $("t-drift").className = "value" + (d.firing ? " bad" : "");
    badge.textContent = d.firing ? "drift alarm firing" : "no alarm";
    badge.title = d.exported
      ? d.classes.map((c) => `${c.prefix_class}: ${c.firing ? "firing" : "clear"}`).join("\n")
      : "the drift alarm is off (drift.enabled)";
    badge.className = "badge" + (d.firing ? " firing" : d.exported ? "" : " none");
  }

  function renderWorkers(workers) {
    const body = $("workers").tBodies[0];
    body.replaceChildren();
    for (const w of workers) {
      const kv = el("span", { class: "kv" }, el("span", {}));
      kv.firstChild.style.width = Math.round(100 * (w.kv_usage || 0)) + "%";
      const pref = el("td", { class: "prefixes" });
      if (!w.prefixes.length) pref.append("–");
      for (const p of w.prefixes) {
        pref.append(el("code", { title: p.key }, p.key.slice(0, 8)), ` ${p.class} ${fmt(p.saved_tokens, 0)} tok (${p.hits}×)  `);
      }
      body.append(el("tr", { "data-worker": w.id },
        el("td", {}, w.id), el("td", { class: "st-" + w.state.replace(/[^a-z]+/g, "-") }, w.state),
        el("td", {}, fmt(w.in_flight, 0)), el("td", {}, fmt(w.queue, 0)), el("td", {}, fmt(w.running, 0)),
        el("td", {}, kv, " " + pct(w.kv_usage)), el("td", {}, pct(w.cached_share)),
        el("td", {}, pct(w.engine_hit_rate)),
        // A capacity of null: the engine's KV size is not known yet (never polled), and the
        // index's default in its place would read as a fact.
        el("td", {}, `${fmt(w.index_blocks, 0)} / ${w.index_capacity === null ? "unknown" : fmt(w.index_capacity, 0)}`),
        pref));
    }
  }

  function series(pick) {
    return state.history.map((p) => {
      const c = (p.classes || {})[state.cls];
      return [p.t, c ? pick(c, p) : null];
    });
  }
  function renderCharts() {
    lineChart($("c-ttft"), HITS.map((h, i) => ({
      name: h, color: `var(--${h})`, values: series((c) => c.ttft_ms[i]),
    })), "ms");
    lineChart($("c-tokens"), [
      { name: "cached", color: "var(--cached)", values: series((c) => c.cached_per_s) },
      { name: "uncached", color: "var(--uncached)", values: series((c) => c.uncached_per_s) },
    ], "tok/s");
    lineChart($("c-pred"), [
      { name: "predicted", color: "var(--pred)", values: series((c, p) => c.predicted * p.scale) },
      { name: "actual", color: "var(--act)", values: series((c, p) => c.actual * p.scale) },
    ], "tok");
    const lag = state.history.map((p) => [p.t, p.lag_p99_ms === undefined ? null : p.lag_p99_ms]);
    const hasLag = lag.some((v) => v[1] !== null);
    $("lag-figure").hidden = !hasLag;
    if (hasLag) lineChart($("c-lag"), [{ name: "p99", color: "var(--cold)", values: lag }], "ms");
  }

  // A line chart over the history: x = time, y from 0 to the largest value; nulls break a line.
  function lineChart(svg, list, unit) {
    const W = 480, H = 180, L = 46, R = 8, T = 16, B = 18;
    svg.replaceChildren();
    const pts = list.flatMap((s) => s.values);
    if (!pts.length) return;
    const t0 = Math.min(...pts.map((p) => p[0])), t1 = Math.max(...pts.map((p) => p[0]));
    const ymax = Math.max(1e-9, ...pts.map((p) => (p[1] === null ? 0 : p[1])));
    const x = (t) => L + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * (W - L - R);
    const y = (v) => T + (1 - v / ymax) * (H - T - B);
    for (const f of [0, 0.5, 1]) {
      const v = ymax * f;
      svg.append(sv("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const lab = sv("text", { class: "axis", x: L - 4, y: y(v) + 3, "text-anchor": "end" });
      lab.textContent = fmt(v);
      svg.append(lab);
    }
    const span = sv("text", { class: "axis", x: W - R, y: H - 4, "text-anchor": "end" });
    span.textContent = `last ${fmt(t1 - t0, 0)} s · ${unit}`;
    svg.append(span);
    let lx = L;
    for (const s of list) {
      // Seconds without such a request (null) are skipped, not drawn as zero: a line joins
      // the seconds that had one, and a dot marks each.
      let d = "";
      for (const [t, v] of s.values) {
        if (v === null) continue;
        d += (d ? "L" : "M") + x(t).toFixed(1) + "," + y(v).toFixed(1);
        const dot = sv("circle", { cx: x(t).toFixed(1), cy: y(v).toFixed(1), r: 1.6 });
        dot.style.fill = s.color; // CSSOM, which the page's CSP allows (no inline styles)
        svg.append(dot);
      }
      if (d) {
        const path = sv("path", { class: "series", d });
        path.style.stroke = s.color;
        svg.append(path);
      }
      const last = [...s.values].reverse().find((p) => p[1] !== null);
      const leg = sv("text", { class: "legend", x: lx, y: 10 });
      leg.style.fill = s.color;
      leg.textContent = `■ ${s.name} ${last ? fmt(last[1]) : "–"}`;
      svg.append(leg);
      lx += 110;
    }
  }

  function barList(box, rows, unit) {
    box.replaceChildren();
    if (!rows.length) { box.append(el("div", { class: "note" }, "nothing yet")); return; }
    const max = Math.max(1e-9, ...rows.map((r) => r[1] || 0));
    for (const [label, v, note] of rows) {
      const bar = el("div", { class: "bar" });
      bar.style.width = (100 * (v || 0) / max).toFixed(1) + "%";
      box.append(el("div", { class: "row" }, el("span", {}, label), el("div", {}, bar),
        el("span", { class: "num" }, fmt(v) + (unit ? " " + unit : "") + (note || ""))));
    }
  }
  function renderBars(win, evictions) {
    const wait = win ? Object.entries(win.wait).map(([t, p]) => [t, mean(p)]) : [];
    barList($("b-wait"), wait.sort(), "ms");
    const tiers = win ? Object.entries(win.tiers) : [];
    barList($("b-tiers"), tiers.sort((a, b) => b[1] - a[1]), "");
    const byClass = Object.entries(evictions.by_class || {}).map(([c, n]) => [`class ${c}`, n]);
    barList($("b-evict"), [...evictions.age_buckets.filter((b) => b[1] > 0), ...byClass], "");
  }

  function renderClasses(classes, order) {
    const body = $("classes").tBodies[0];
    body.replaceChildren();
    for (const c of ["*", ...order]) {
      const a = classes[c];
      if (!a) continue;
      const tr = el("tr", { "data-class": c },
        el("td", {}, c === "*" ? "all" : c), el("td", {}, fmt(a.n, 0)),
        el("td", {}, pct(ratio(a.cached, a.cached + a.uncached))),
        ...HITS.map((h) => el("td", {}, fmt(mean(a.ttft[h])) + " ms")),
        el("td", {}, fmt(a.predicted, 0)), el("td", {}, fmt(a.actual, 0)),
        el("td", {}, fmt(a.reported ? a.abs_error / a.reported : null)),
        el("td", {}, pct(ratio(a.abandoned, a.n))), el("td", {}, fmt(a.errors, 0)));
      if (c === state.cls) tr.className = "selected";
      body.append(tr);
    }
  }

  function renderCluster(c) {
    $("cluster").hidden = !c;
    if (!c) return;
    const box = $("cluster-info");
    box.replaceChildren(
      el("p", {}, `This replica: ${c.replica} (life ${c.life}) · ${c.connected ? "connected" : "disconnected"} · ` +
        `${c.ready ? "ready" : "replaying"} · facts published ${fmt(c.facts_published_per_s)}/s, ` +
        `applied ${fmt(c.facts_applied_per_s)}/s · propagation lag p50 ${fmt(c.lag_ms.p50)} ms, ` +
        `p99 ${fmt(c.lag_ms.p99)} ms (newest ${c.lag_ms.samples} messages). Every decision ` +
        `listed below was made by this replica (its "replica" field).`));
    const t = el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "peer replica"), el("th", {}, "its routings in flight here"))));
    const tb = el("tbody");
    for (const p of c.peers) tb.append(el("tr", {}, el("td", {}, p.replica), el("td", {}, fmt(p.in_flight_here, 0))));
    t.append(tb);
    box.append(t);
  }

  function renderDecisions() {
    const body = $("decisions").tBodies[0];
    body.replaceChildren();
    const list = state.decisions.filter((d) => state.cls === "*" || d.prefix_class === state.cls);
    for (const d of list) {
      const tr = el("tr", { "data-request": d.request_id },
        el("td", {}, new Date(d.ts * 1000).toLocaleTimeString()),
        el("td", { class: "left" }, String(d.request_id).slice(0, 18)),
        el("td", {}, d.prefix_class), el("td", {}, el("span", { class: "tier tier-" + d.tier }, d.tier)),
        el("td", {}, d.selected_worker), el("td", {}, fmt(d.predicted_cached_tokens, 0)),
        el("td", {}, fmt(d.actual_cached_tokens, 0)),
        el("td", {}, d.ttft_ms === null ? "–" : fmt(d.ttft_ms) + " ms"));
      if (state.selected && state.selected.request_id === d.request_id) tr.className = "selected";
      tr.addEventListener("click", () => { state.selected = d; explain(d); renderDecisions(); });
      body.append(tr);
    }
  }

  const TERMS = [
    ["predicted_ttft_ms", "TTFT"], ["queue_wait_ms", "queue wait"], ["prefill_ms", "prefill"],
    ["decode_impact_ms", "decode impact"], ["memory_risk_ms", "memory risk"],
    ["memory_risk_freed_ms", "memory (freed)"], ["decode_ms", "decode"], ["eviction_ms", "eviction"],
  ];
  function explain(d) {
    const box = $("explain");
    const dl = el("dl");
    const row = (k, v) => dl.append(el("dt", {}, k), el("dd", {}, v === null || v === undefined ? "–" : String(v)));
    row("request", d.request_id);
    row("decided by", d.replica ? `replica ${d.replica}` : "this gateway");
    row("policy", d.policy);
    row("tier", d.tier);
    row("reason", d.reason);
    row("chosen worker", d.selected_worker);
    row("prefix", `${d.prefix_key} (${d.prefix_class})`);
    row("predicted cached", `${fmt(d.predicted_cached_tokens, 0)} tokens of ~${fmt(d.estimated_prompt_tokens, 0)}`);
    row("actual cached", d.actual_cached_tokens === null ? "not reported"
      : `${fmt(d.actual_cached_tokens, 0)} tokens of ${fmt(d.prompt_tokens, 0)}`);
    row("predicted TTFT", d.predicted_ttft_ms === null ? "–" : fmt(d.predicted_ttft_ms) + " ms");
    row("actual TTFT", d.ttft_ms === null ? "not streamed" : fmt(d.ttft_ms) + " ms");
    row("warm abandoned", d.warm_abandoned ? "yes: the warm worker's wait made it too slow (a copy)" : "no");
    row("status", `${d.status}${d.error ? " · " + d.error : ""}`);
    if (d.retried_from && d.retried_from.length) row("retried from", d.retried_from.join(", "));
    if (d.sampled_every > 1) row("sampling", `one of every ${d.sampled_every} decisions of its second`);
    const heads = ["worker", "matched", "conf.", "score", ...TERMS.map((t) => t[1] + " ms")];
    const t = el("table", { "data-testid": "candidates" },
      el("thead", {}, el("tr", {}, ...heads.map((h) => el("th", {}, h)))));
    const tb = el("tbody");
    for (const c of d.candidate_workers) {
      const tr = el("tr", {}, el("td", {}, c.worker), el("td", {}, fmt(c.matched_tokens, 0)),
        el("td", {}, fmt(c.confidence)), el("td", {}, fmt(c.score, 4)),
        ...TERMS.map(([k]) => el("td", {}, fmt(c[k]))));
      if (c.worker === d.selected_worker) tr.className = "chosen";
      tb.append(tr);
    }
    t.append(tb);
    const filtered = Object.entries(d.filtered || {});
    box.replaceChildren(el("h2", {}, "Why " + d.selected_worker + "?"), dl,
      el("h2", {}, "Candidates (lower score wins; terms from the cost model)"),
      el("div", { class: "scroll" }, t));
    if (filtered.length) {
      box.append(el("h2", {}, "Filtered out"),
        el("ul", {}, ...filtered.map(([w, why]) => el("li", {}, `${w}: ${why}`))));
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    initKey();
    $("class").addEventListener("change", (ev) => { state.cls = ev.target.value; render(); });
    connect();
  });
})();
