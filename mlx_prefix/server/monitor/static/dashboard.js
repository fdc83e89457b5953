// The mlx-prefix dashboard: polls GET /v1/dashboard and renders it; actions call the API.
//
// Polling rather than server-sent events: the API key goes in an Authorization header,
// which EventSource cannot send; a poll is one small, stateless request that holds no
// connection open (an open SSE stream would hold up the server's graceful shutdown,
// which waits for open connections); and one snapshot a second is what a person reads.
// Polling stops while the tab is hidden.
"use strict";
(() => {
  const POLL_MS = 1000;
  const RETRY_MS = 5000;
  const KEY = "mlx-prefix-api-key"; // sessionStorage: this tab only, gone when it closes
  const KINDS = ["SYSTEM", "BREAKPOINT", "LAST_MESSAGE", "HISTORY", "PERIODIC", "CANCELLED"];
  const $ = (id) => document.getElementById(id);
  let timer = null;
  let charts = null;
  let lastRequestSeq = -1;
  let messageTimer = null;
  const rows = new Map(); // tree node id -> <tr>, kept across polls

  // -- the API ---------------------------------------------------------------------
  function headers(json) {
    const h = {};
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    if (json) h["Content-Type"] = "application/json";
    return h;
  }

  async function call(method, path, body) {
    const init = { method, headers: headers(body !== undefined), cache: "no-store" };
    if (body !== undefined) init.body = JSON.stringify(body);
    const r = await fetch(path, init);
    let data = null;
    try {
      data = await r.json();
    } catch (e) {
      data = null;
    }
    if (!r.ok) {
      const err = new Error((data && data.error && data.error.message) || `HTTP ${r.status}`);
      err.status = r.status;
      throw err;
    }
    return data;
  }

  async function poll() {
    clearTimeout(timer);
    let wait = POLL_MS;
    try {
      render(await call("GET", "/v1/dashboard"));
      setStatus("live", "live · " + new Date().toLocaleTimeString());
    } catch (e) {
      wait = RETRY_MS;
      if (e.status === 401) {
        $("key-form").classList.remove("hidden");
        setStatus("error", "API key needed");
      } else {
        setStatus("error", e.status ? e.message : "server unreachable");
      }
    }
    if (!document.hidden) timer = setTimeout(poll, wait);
  }

  function setStatus(cls, text) {
    const el = $("status");
    el.className = "status " + cls;
    el.textContent = text;
  }

  function showMessage(text, error) {
    const el = $("message");
    el.textContent = text;
    el.className = "message" + (error ? " error" : "");
    clearTimeout(messageTimer);
    messageTimer = setTimeout(() => el.classList.add("hidden"), error ? 10000 : 5000);
  }

  async function act(label, method, path, body) {
    try {
      const result = await call(method, path, body);
      await poll();
      return result;
    } catch (e) {
      showMessage(`${label} failed: ${e.message}`, true);
      if (e.status === 401) $("key-form").classList.remove("hidden");
      return null;
    }
  }

  // -- formatting ------------------------------------------------------------------
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i === 0 ? n : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
  }
  const int = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
  function ago(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return Math.round(s) + " s";
    if (s < 3600) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  const pct = (part, whole) => (whole ? Math.round((100 * part) / whole) + "%" : "–");
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }
  function idCell(id) {
    const td = el("td", "id", id.length > 20 ? id.slice(0, 18) + "…" : id);
    td.title = id;
    return td;
  }
  const kindClass = (kind) => "k-" + (KINDS.includes(kind) ? kind : "other");

  // -- rendering -------------------------------------------------------------------
  function render(d) {
    setText($("model"), d.model);
    renderCards(d);
    renderCharts(d.requests);
    renderJobs(d.activity);
    renderTree(d.tree);
    renderRequests(d.requests);
    renderMisses(d.misses || []);
  }

  function bar(container, legend, parts, total) {
    container.replaceChildren();
    legend.replaceChildren();
    for (const p of parts) {
      if (p.bytes > 0 && total > 0) {
        const seg = el("span", p.cls);
        seg.style.width = Math.min(100, (100 * p.bytes) / total) + "%";
        seg.style.minWidth = "3px"; // a sliver of a large budget stays visible
        seg.title = `${p.label}: ${bytes(p.bytes)}`;
        container.append(seg);
      }
      const item = el("span");
      item.append(el("i", p.cls), `${p.label} ${bytes(p.bytes)}${p.note || ""}`);
      legend.append(item);
    }
  }

  function renderCards(d) {
    const m = d.memory;
    const lookups = m.hits + m.misses;
    $("hit-rate").textContent = lookups ? (100 * m.hit_ratio).toFixed(0) + "%" : "–";
    const reqs = d.requests.filter((r) => r.cached_tokens !== null);
    const prompt = reqs.reduce((a, r) => a + r.prompt_tokens, 0);
    const cached = reqs.reduce((a, r) => a + r.cached_tokens, 0);
    $("hit-detail").textContent =
      `${int(m.hits)} hits, ${int(m.misses)} misses · ${int(m.tokens_reused)} tokens reused` +
      (prompt ? ` · last ${reqs.length} requests: ${pct(cached, prompt)} of prompt tokens reused` : "");

    const kinds = Object.keys(m.bytes_by_kind).sort(
      (a, b) => (KINDS.indexOf(a) + 99) % 99 - (KINDS.indexOf(b) + 99) % 99,
    );
    const parts = kinds
      .filter((k) => m.bytes_by_kind[k] > 0 || KINDS.includes(k))
      .map((k) => ({
        cls: kindClass(k),
        label: k.toLowerCase().replace("_", " "),
        bytes: m.bytes_by_kind[k],
        note: (m.entries_by_kind || {})[k] ? ` (${m.entries_by_kind[k]})` : "",
      }));
    parts.push({ cls: "k-active", label: "running requests", bytes: m.active_bytes });
    bar($("mem-bar"), $("mem-legend"), parts, m.budget_bytes);
    $("mem-total").textContent =
      `${bytes(m.bytes + m.active_bytes)} of ${bytes(m.budget_bytes)} · ` +
      `${int(m.entries)} entries, ${int(m.pinned)} pinned, ${int(m.evictions)} evicted`;

    const disk = d.disk;
    $("disk-bar").classList.toggle("hidden", disk === null);
    if (disk === null) {
      $("disk-total").textContent = "off";
      $("disk-legend").textContent = "Checkpoints stay in memory only (--disk-cache off).";
    } else {
      const budget = disk.budget_bytes;
      $("disk-total").textContent =
        `${bytes(disk.bytes)} of ${budget === null ? "unlimited" : bytes(budget)}`;
      bar($("disk-bar"), $("disk-legend"), [
        { cls: "k-disk", label: `${int(disk.files)} files`, bytes: disk.bytes,
          note: ` · ${int(disk.pending_saves)} waiting to be written · ${int(disk.hits)} loads` },
      ], budget || disk.bytes);
      $("disk-bar").title = disk.directory;
    }

    const jobs = d.activity.jobs;
    const count = (pred) => jobs.filter(pred).length;
    const running = count((j) => j.state !== "queued" && j.role !== "prefetch");
    const queued = count((j) => j.state === "queued" && j.role !== "prefetch");
    $("engine-summary").textContent = `${running} running`;
    const p = d.prefetch || {};
    const prefetching = count((j) => j.role === "prefetch");
    $("prefetch-summary").textContent =
      `${queued} queued · up to ${d.activity.capacity} decode together · prefetches: ` +
      `${prefetching} now, ${int(p.completed)} done, ${int(p.cancelled)} dropped, ` +
      `${int(p.tokens)} tokens`;
  }

  // uPlot charts over the last requests, x = the request's number
  function makeCharts() {
    const bars = uPlot.paths.bars({ size: [0.7, 40] });
    const x = { label: "request", value: (u, v) => (v === null ? "–" : "#" + v) };
    // request numbers: whole ticks only, and half a bar of room on either side
    const xScale = { time: false, range: (u, min, max) => [min - 0.5, max + 0.5] };
    const xAxis = { incrs: [1, 2, 5, 10, 20, 50, 100, 200], values: (u, ticks) => ticks.map(String) };
    const width = $("chart-tokens").clientWidth || 500;
    const tokens = new uPlot({
      width, height: 220,
      scales: { x: xScale },
      series: [
        x,
        { label: "prompt tokens", stroke: "#f59e0b", fill: "rgba(245,158,11,0.45)", paths: bars,
          points: { show: false }, value: (u, v) => int(v) },
        { label: "reused from the cache", stroke: "#2563eb", fill: "rgba(37,99,235,0.85)",
          paths: bars, points: { show: false }, value: (u, v) => int(v) },
      ],
      axes: [xAxis, { size: 60 }],
    }, [[], [], []], $("chart-tokens"));
    const speed = new uPlot({
      width, height: 220,
      scales: { x: xScale, ms: {}, tps: {} },
      series: [
        x,
        { label: "TTFT ms", scale: "ms", stroke: "#2563eb", width: 2, spanGaps: true,
          points: { size: 5 }, value: (u, v) => (v === null ? "–" : v.toFixed(0)) },
        { label: "decode tok/s", scale: "tps", stroke: "#15803d", width: 2, spanGaps: true,
          points: { size: 5 }, value: (u, v) => (v === null ? "–" : v.toFixed(1)) },
      ],
      axes: [xAxis, { scale: "ms", size: 60, label: "ms" },
        { scale: "tps", side: 1, size: 50, label: "tok/s", grid: { show: false } }],
    }, [[], [], []], $("chart-speed"));
    window.addEventListener("resize", () => {
      for (const [chart, box] of [[tokens, "chart-tokens"], [speed, "chart-speed"]]) {
        chart.setSize({ width: $(box).clientWidth, height: 220 });
      }
    });
    return { tokens, speed };
  }

  function renderCharts(requests) {
    const last = requests.length ? requests[requests.length - 1].seq : 0;
    if (last === lastRequestSeq) return;
    lastRequestSeq = last;
    if (typeof uPlot === "undefined") return;
    charts = charts || makeCharts();
    const served = requests.filter((r) => r.cached_tokens !== null);
    const xs = served.map((r) => r.seq);
    charts.tokens.setData([xs, served.map((r) => r.prompt_tokens), served.map((r) => r.cached_tokens)]);
    charts.speed.setData([
      xs,
      served.map((r) => (r.ttft_s === null ? null : r.ttft_s * 1000)),
      served.map((r) => (r.completion_tokens > 1 ? r.decode_tokens_per_s : null)),
    ]);
  }

  function progress(done, total, label) {
    const box = el("div", "progress");
    const fill = el("span");
    fill.style.width = (total ? Math.min(100, (100 * done) / total) : 0) + "%";
    box.append(fill, el("em", "", label));
    return box;
  }

  function renderJobs(activity) {
    const body = $("jobs").tBodies[0];
    body.replaceChildren();
    for (const j of activity.jobs) {
      const tr = el("tr");
      let bar;
      if (j.state === "queued") bar = el("span", "muted", "waiting");
      else if (j.state === "prefilling")
        bar = progress(j.cached_tokens + j.computed_tokens, j.prompt_tokens,
          `prefill ${int(j.cached_tokens + j.computed_tokens)} / ${int(j.prompt_tokens)}`);
      else bar = progress(j.generated_tokens, j.max_tokens,
        `${int(j.generated_tokens)} / ${int(j.max_tokens)} tokens`);
      const progressCell = el("td");
      progressCell.append(bar);
      tr.append(
        idCell(j.request_id), el("td", "", j.role), el("td", "", j.state),
        el("td", "num", int(j.prompt_tokens)),
        el("td", "num", j.state === "queued" ? "–" : int(j.cached_tokens)),
        progressCell, el("td", "num", ago(j.age_s)),
      );
      body.append(tr);
    }
    $("jobs-empty").classList.toggle("hidden", activity.jobs.length > 0);
    $("jobs-count").textContent = activity.jobs.length ? `(${activity.jobs.length})` : "";
  }

  // The tree as a table in pre-order, one row per stored sequence, rows kept by node id
  // so that a poll does not rebuild the buttons under the pointer.
  function treeRow(id) {
    const tr = el("tr");
    tr.dataset.node = id;
    const text = el("td", "text");
    text.append(el("span", "guide"), el("span", "head"), el("span", "range"));
    const actions = el("td", "actions");
    const pin = el("button", "pin");
    pin.type = "button";
    pin.dataset.action = "pin";
    const evict = el("button", "evict", "evict");
    evict.type = "button";
    evict.dataset.action = "evict";
    actions.append(pin, " ", evict);
    tr.append(text, el("td", "num"), el("td"), el("td", "num"), el("td", "num"), el("td", "num"),
      el("td"), actions);
    return tr;
  }

  function renderTree(nodes) {
    const body = $("tree").tBodies[0];
    const depth = new Map();
    const seen = new Set();
    nodes.forEach((n, i) => {
      depth.set(n.id, n.parent === null ? 0 : depth.get(n.parent) + 1);
      seen.add(n.id);
      let tr = rows.get(n.id);
      if (!tr) {
        tr = treeRow(n.id);
        rows.set(n.id, tr);
      }
      fillTreeRow(tr, n, depth.get(n.id));
      if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null);
    });
    for (const [id, tr] of rows) {
      if (!seen.has(id)) {
        tr.remove();
        rows.delete(id);
      }
    }
    $("tree-empty").classList.toggle("hidden", nodes.length > 0);
    const inMemory = nodes.filter((n) => n.entry_id !== null).length;
    $("tree-count").textContent = nodes.length
      ? `(${inMemory} in memory, ${nodes.length - inMemory} on disk only)` : "";
  }

  function fillTreeRow(tr, n, level) {
    const [text, tokens, kind, mem, hits, idle, disk, actions] = tr.children;
    tr.dataset.entry = n.entry_id === null ? "" : String(n.entry_id);
    tr.dataset.pinned = n.pinned ? "1" : "";
    tr.classList.toggle("disk-only", n.entry_id === null);
    setText(text.children[0], level ? "  ".repeat(level - 1) + "└ " : "");
    setText(text.children[1], (n.start ? "… " : "") + n.head.replace(/\s+/g, " ").trim() +
      (n.tokens - n.start > 24 ? " …" : ""));
    const images = (n.images || []).map(([a, b]) => ` image [${int(a)}–${int(b)})`).join("");
    setText(text.children[2], `[${int(n.start)}–${int(n.tokens)})` + images);
    setText(tokens, int(n.tokens));
    if (kind.dataset.kind !== n.kind) {
      kind.dataset.kind = n.kind;
      kind.replaceChildren(el("span", "tag " + kindClass(n.kind), n.kind.toLowerCase().replace("_", " ")));
    }
    setText(mem, n.entry_id === null ? "–" : bytes(n.bytes));
    setText(hits, n.hits === null ? "–" : int(n.hits));
    setText(idle, ago(n.idle_s) + " ago");
    const state = [n.disk_bytes === null ? "–" : "saved " + bytes(n.disk_bytes),
      n.pinned ? "pinned" : "", n.in_use ? "in use" : ""].join("|");
    if (disk.dataset.state !== state) {
      disk.dataset.state = state;
      disk.replaceChildren(n.disk_bytes === null ? "–" : "saved " + bytes(n.disk_bytes));
      if (n.pinned) disk.append(" ", el("span", "badge pinned", "pinned"));
      if (n.in_use) disk.append(" ", el("span", "badge busy", "in use"));
    }
    const [pin, evict] = actions.querySelectorAll("button");
    const memory = n.entry_id !== null;
    pin.hidden = evict.hidden = !memory;
    setText(pin, n.pinned ? "unpin" : "pin");
    pin.title = n.pinned ? "let eviction remove it again" : "never evict it";
    evict.disabled = n.pinned || n.in_use;
    evict.title = n.pinned ? "unpin it first" : n.in_use ? "a running request uses it"
      : "drop it from memory" + (n.disk_bytes === null ? "" : " (the disk copy stays)");
  }

  function renderRequests(requests) {
    const body = $("requests").tBodies[0];
    const newest = requests.slice(-50).reverse();
    if (body.dataset.seq === String(newest.length ? newest[0].seq : 0)) return;
    body.dataset.seq = String(newest.length ? newest[0].seq : 0);
    body.replaceChildren(...newest.map((r) => {
      const tr = el("tr");
      const ok = r.status === "200";
      const cached = r.cached_tokens === null ? "–"
        : `${int(r.cached_tokens)} (${pct(r.cached_tokens, r.prompt_tokens)})`;
      tr.append(
        el("td", "", new Date(r.finished_at * 1000).toLocaleTimeString()),
        idCell(r.request_id), el("td", "", r.endpoint),
        el("td", "num", int(r.prompt_tokens)), el("td", "num", cached),
        el("td", "num", int(r.completion_tokens)),
        el("td", "num", r.ttft_s === null ? "–" : (r.ttft_s * 1000).toFixed(0) + " ms"),
        el("td", "num", r.prefill_tokens_per_s ? r.prefill_tokens_per_s.toFixed(0) : "–"),
        el("td", "num", r.decode_tokens_per_s ? r.decode_tokens_per_s.toFixed(1) : "–"),
        el("td", ok ? "" : "status-bad", ok ? r.finish || "" : r.status),
      );
      return tr;
    }));
    $("requests-empty").classList.toggle("hidden", requests.length > 0);
    $("requests-count").textContent = requests.length ? `(last ${requests.length})` : "";
  }

  function renderMisses(misses) {
    const body = $("misses").tBodies[0];
    const key = misses.length ? misses[0].id + "/" + misses.length : "";
    if (body.dataset.key === key) return;
    body.dataset.key = key;
    body.replaceChildren(...misses.map((m) => {
      const tr = el("tr");
      tr.dataset.reason = m.reason;
      const reason = el("td");
      reason.append(el("span", "badge reason-" + m.reason, m.reason));
      reason.title = m.detail;
      const where = m.diverged_at === null ? "–"
        : `token ${int(m.diverged_at)}` + (m.location
          ? `, message ${m.location.message} (${m.location.role})` : "");
      const texts = el("td", "text");
      if (m.before !== null || m.after !== null) {
        texts.append(el("div", "head was", m.before || ""), el("div", "head now", m.after || ""));
      } else {
        texts.append(el("span", "muted", m.detail));
      }
      tr.append(
        el("td", "", new Date(m.created * 1000).toLocaleTimeString()), idCell(m.id), reason,
        el("td", "num", `${int(m.cached_tokens)} / ${int(m.prompt_tokens)}`),
        el("td", "num", int(m.lost_tokens)), el("td", "", where), texts,
      );
      return tr;
    }));
    $("misses-empty").classList.toggle("hidden", misses.length > 0);
    $("misses-count").textContent = misses.length ? `(last ${misses.length})` : "";
  }

  // -- actions ---------------------------------------------------------------------
  $("tree").tBodies[0].addEventListener("click", (ev) => {
    const button = ev.target.closest("button");
    if (!button) return;
    const tr = button.closest("tr");
    const entry = tr.dataset.entry;
    if (!entry) return;
    if (button.dataset.action === "pin") {
      const pinned = !tr.dataset.pinned;
      act(pinned ? "Pin" : "Unpin", "POST", `/v1/cache/entries/${entry}/pin`, { pinned });
    } else if (button.dataset.action === "evict") {
      act("Evict", "DELETE", `/v1/cache/entries/${entry}`);
    }
  });

  $("flush").addEventListener("click", async () => {
    if (!window.confirm("Remove every cache entry of this model, in memory and on disk?")) return;
    const r = await act("Flush", "DELETE", "/v1/cache");
    if (r) showMessage(`Flushed: ${r.removed} entries removed.`);
  });

  $("warm").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const text = $("warm-text").value;
    if (!text.trim()) return;
    const pin = $("warm-pin").checked;
    const body = $("warm-as").value === "system"
      ? { messages: [{ role: "system", content: text }], pin }
      : { prompt: text, pin };
    const button = ev.target.querySelector("button");
    button.disabled = true;
    showMessage("Warming…");
    try {
      const r = await act("Warm", "POST", "/v1/cache/warm", body);
      if (r) {
        showMessage(`Warmed ${int(r.prompt_tokens)} tokens (${int(r.cached_tokens)} were ` +
          `already cached)${r.pinned ? ", pinned" : ""}.`);
      }
    } finally {
      button.disabled = false;
    }
  });

  $("key-button").addEventListener("click", () => $("key-form").classList.toggle("hidden"));
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key-input").value);
    $("key-input").value = "";
    $("key-form").classList.add("hidden");
    poll();
  });
  $("key-clear").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    poll();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) clearTimeout(timer);
    else poll();
  });
  poll();
})();
