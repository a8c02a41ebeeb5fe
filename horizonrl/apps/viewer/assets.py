"""The viewer's style sheet and script, served from memory: no build step, no CDN (a run's machine
may have no internet), nothing to list as package data.

The script does two things, and every page works without it (links with ``?turn=k``):
- on an episode or comparison page, steps through the turns in place (buttons, arrow keys), loading
  each BabyAI frame when its turn is shown and the next one ahead;
- on a list page, polls ``/api/episodes`` every two seconds and inserts the new episodes that match
  the filters at the top of the table, so a page left open follows the run.
"""

STYLE = """
:root { --fg: #1d2330; --muted: #667085; --line: #d9dde5; --bg: #f6f7f9; --ok: #17803d; --bad: #b42318;
        --accent: #2754c5; --new: #fff6d6; font-family: system-ui, sans-serif; font-size: 14px; color: var(--fg); }
body { margin: 0; background: var(--bg); }
header nav { display: flex; gap: 1.2em; align-items: baseline; padding: .6em 1.2em; background: #1d2330; }
header nav a { color: #dfe6f5; text-decoration: none; }
header nav a.brand { font-weight: 700; color: #fff; }
header nav .run { color: #98a2b3; font-family: monospace; margin-left: auto; }
header nav #live { color: #98a2b3; min-width: 12em; text-align: right; }
main { padding: 1em 1.2em 3em; }
h1 { font-size: 1.4em; margin: .2em 0 .6em; }
h2 { font-size: 1.15em; }
a { color: var(--accent); }
form.filters { display: flex; flex-wrap: wrap; gap: .6em 1.2em; align-items: end; background: #fff;
               border: 1px solid var(--line); padding: .8em; border-radius: 6px; }
form.filters label { display: flex; flex-direction: column; font-size: .85em; color: var(--muted); gap: .2em; }
form.filters input[type=number] { width: 5.5em; }
form.filters .pair { display: flex; gap: .3em; align-items: center; }
form.filters button { padding: .35em 1.2em; }
.errors { color: var(--bad); }
.summary { color: var(--muted); }
table.episodes, table.plain { border-collapse: collapse; background: #fff; width: 100%; }
table.episodes th, table.episodes td, table.plain th, table.plain td {
  border-bottom: 1px solid var(--line); padding: .35em .6em; text-align: left; vertical-align: top; }
table.episodes th, table.plain th { background: #eef1f6; font-weight: 600; position: sticky; top: 0; }
tr.new td { background: var(--new); transition: background 2s; }
.ok { color: var(--ok); font-weight: 600; }
.bad { color: var(--bad); font-weight: 600; }
.muted, .small { color: var(--muted); }
.small { font-size: .85em; }
code { font-size: .95em; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .25em 1em; background: #fff;
           border: 1px solid var(--line); border-radius: 6px; padding: .8em; margin: 0 0 1em; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; }
.stepper { display: flex; gap: .6em; align-items: center; margin: .8em 0; position: sticky; top: 0;
           background: var(--bg); padding: .4em 0; z-index: 1; }
.stepper a, .stepper button { border: 1px solid var(--line); background: #fff; padding: .3em .8em; border-radius: 4px;
                              text-decoration: none; color: var(--fg); cursor: pointer; font-size: 1em; }
.stepper a.disabled { opacity: .4; pointer-events: none; }
#position { min-width: 8em; text-align: center; font-weight: 600; }
.replay .position { display: none; grid-template-columns: minmax(200px, max-content) 1fr; gap: 1em;
                    background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: .8em;
                    margin-bottom: .8em; }
.replay .position.current, body.all-turns .replay .position { display: grid; }
.position h3 { margin: 0 0 .4em; }
.position h4 { margin: .8em 0 .2em; color: var(--muted); font-size: .85em; text-transform: uppercase; }
pre { white-space: pre-wrap; word-break: break-word; background: #f3f4f7; padding: .6em; margin: 0;
      border-radius: 4px; font-size: .95em; }
pre.reply { background: #eef4ff; }
img.frame { image-rendering: pixelated; max-width: 100%; border: 1px solid var(--line); display: block; }
table.inventory { border-collapse: collapse; }
table.inventory td, table.inventory th { padding: .15em .6em; border-bottom: 1px solid var(--line); text-align: left; }
.score { font-size: 1.1em; }
.no-state { color: var(--muted); max-width: 28em; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
.sides .replay .position { grid-template-columns: 1fr; }
.pages { margin-top: .8em; display: flex; gap: 1em; }
"""

SCRIPT = r"""
"use strict";
(function () {
  // ---------------------------------------------------------------- turn by turn
  const replays = Array.from(document.querySelectorAll(".replay"));
  const stepper = document.querySelector(".stepper");

  function positionsOf(replay) { return Array.from(replay.querySelectorAll(".position")); }

  function load(img) {
    if (img && !img.getAttribute("src") && img.dataset.src) { img.setAttribute("src", img.dataset.src); }
  }

  function show(k) {
    const last = Math.max(0, ...replays.map((r) => positionsOf(r).length - 1));
    k = Math.min(Math.max(0, k), last);
    for (const replay of replays) {
      const sections = positionsOf(replay);
      const own = Math.min(k, sections.length - 1);
      sections.forEach((section, i) => section.classList.toggle("current", i === own));
      load(sections[own].querySelector("img.frame"));
      if (sections[own + 1]) { load(sections[own + 1].querySelector("img.frame")); }  // ahead of the click
      const ended = replay.querySelector(".ended");
      if (ended) { ended.hidden = k <= sections.length - 1; }
    }
    stepper.dataset.current = String(k);
    document.getElementById("position").textContent = k === 0 ? "Start (turn 0 of " + last + ")"
                                                              : "Turn " + k + " of " + last;
    const targets = { first: 0, prev: k - 1, next: k + 1, last: last };
    for (const [id, target] of Object.entries(targets)) {
      const button = document.getElementById(id);
      const params = new URLSearchParams(window.location.search);
      params.set("turn", String(Math.min(Math.max(0, target), last)));
      button.setAttribute("href", "?" + params.toString());
      button.classList.toggle("disabled", (id === "first" || id === "prev") ? k === 0 : k === last);
    }
    const params = new URLSearchParams(window.location.search);
    params.set("turn", String(k));
    window.history.replaceState(null, "", "?" + params.toString());
  }

  if (stepper && replays.length) {
    const current = () => Number(stepper.dataset.current || "0");
    const moves = { first: () => 0, prev: () => current() - 1, next: () => current() + 1, last: () => 1e9 };
    for (const [id, target] of Object.entries(moves)) {
      document.getElementById(id).addEventListener("click", (event) => { event.preventDefault(); show(target()); });
    }
    document.addEventListener("keydown", (event) => {
      if (event.target.closest && event.target.closest("input, select, textarea")) { return; }
      const keys = { ArrowLeft: moves.prev, ArrowRight: moves.next, Home: moves.first, End: moves.last };
      if (keys[event.key]) { event.preventDefault(); show(keys[event.key]()); }
    });
    const all = document.getElementById("show-all");
    all.addEventListener("click", () => {
      const on = document.body.classList.toggle("all-turns");
      all.textContent = on ? "one turn at a time" : "show all turns";
      if (on) {
        document.querySelectorAll("img.frame").forEach((img) => { img.loading = "lazy"; load(img); });
      }
    });
    show(current());
  }

  // ---------------------------------------------------------------- live list
  const table = document.getElementById("episodes");
  const live = document.getElementById("live");
  if (table && table.dataset.poll) {
    let latest = Number(table.dataset.latest);
    let busy = false;
    async function poll() {
      if (busy) { return; }
      busy = true;
      const controller = new AbortController();
      const timer = setTimeout(() => controller.abort(), 5000);
      try {
        const response = await fetch(table.dataset.poll + "&after=" + latest, { signal: controller.signal });
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        const data = await response.json();
        const body = table.tBodies[0];
        const empty = document.getElementById("no-episodes");
        for (const row of data.rows.slice().reverse()) {  // rows come newest first
          const holder = document.createElement("tbody");
          holder.innerHTML = row;
          const tr = holder.firstElementChild;
          tr.classList.add("new");
          body.insertBefore(tr, body.firstChild);
          setTimeout(() => tr.classList.remove("new"), 4000);
        }
        if (data.rows.length && empty) { empty.remove(); }
        latest = data.latest;
        document.getElementById("total").textContent = String(data.total);
        live.textContent = "live · " + data.indexed + " episodes · " + new Date().toLocaleTimeString();
      } catch (error) {
        live.textContent = "not updating (" + error.message + "); retrying";
      } finally {
        clearTimeout(timer);
        busy = false;
      }
    }
    setInterval(poll, 2000);
    live.textContent = "live";
  }
})();
"""
