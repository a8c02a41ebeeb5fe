"""The viewer's HTML: plain functions from the index (and replays) to page text.

Every text from a record is escaped. An episode's turns are all in its page, one ``<section>`` per
position (0 = the start, k = after turn k); the script shows one at a time, and ``?turn=k`` picks the
one shown without it.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from typing import Any, Iterable
from urllib.parse import quote, urlencode

from horizonrl.apps.viewer.index import FAILURE_ANY, FAILURE_NONE, EpisodeFilter, EpisodeIndex, Entry
from horizonrl.apps.viewer.replay import Replay

PAGE_SIZE = 100


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def episode_url(key: str) -> str:
    return "/episode/" + quote(key, safe="")


def frame_url(key: str, position: int) -> str:
    return f"/frame/{quote(key, safe='')}/{position}.png"


def list_url(**query: Any) -> str:
    query = {k: v for k, v in query.items() if v not in (None, "")}
    return "/?" + urlencode(query) if query else "/"


def compare_url(env: str, task_id: Any, **extra: Any) -> str:
    return "/compare?" + urlencode({"env": env, "task": task_id, **extra})


def layout(title: str, body: str, run_label: str, page: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)} · horizonrl view</title>
<link rel="stylesheet" href="/static/viewer.css"><script src="/static/viewer.js" defer></script></head>
<body data-page="{esc(page)}">
<header><nav><a class="brand" href="/">horizonrl view</a><a href="/">Episodes</a><a href="/steps">Learner steps</a>
<a href="/compare">Early vs late</a><span class="run" title="run directory">{esc(run_label)}</span>
<span id="live"></span></nav></header>
<main>
{body}
</main></body></html>
"""


# ------------------------------------------------------------------ pieces
def outcome_html(record: dict[str, Any]) -> str:
    if record.get("success"):
        return '<span class="ok">✓ success</span>'
    return '<span class="bad">✗ failed</span>'


def versions_text(entry: Entry) -> str:
    versions = entry.versions
    if versions is None:
        return "—"
    low, high = versions
    return f"v{low}" if low == high else f"v{low}–{high}"


def step_link(step: int | None, record: dict[str, Any]) -> str:
    if step is not None:
        return f'<a href="/step/{step}">step {step}</a>'
    return '<span class="muted">evaluation</span>' if record.get("evaluation") else '<span class="muted">—</span>'


def when(record: dict[str, Any]) -> tuple[str, str]:
    stamp = record.get("time")
    if not isinstance(stamp, (int, float)):
        return "", ""
    return time.strftime("%H:%M:%S", time.localtime(stamp)), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def episode_row(entry: Entry, index: EpisodeIndex) -> str:
    r = entry.record
    short, full = when(r)
    failure = r.get("failure") or ""
    failure_cell = (f'<span class="bad" title="{esc(r.get("failure_message"))}">{esc(failure)}</span>'
                    if failure else "")
    compare = ""
    if index.early_and_late(r.get("env", ""), r.get("task_id")) is not None:
        compare = f'<a href="{esc(compare_url(r.get("env", ""), r.get("task_id")))}">early vs late</a>'
    return (f'<tr data-key="{esc(entry.key)}" data-seq="{entry.seq}">'
            f'<td title="{esc(full)}">{esc(short)}</td>'
            f'<td><a class="episode-link" href="{esc(episode_url(entry.key))}">{esc(entry.key)}</a></td>'
            f'<td>{esc(r.get("env"))}</td>'
            f'<td>{esc(r.get("task_id"))}<div class="small">{esc(r.get("category"))}</div></td>'
            f'<td class="outcome">{outcome_html(r)}</td>'
            f'<td>{_number(r.get("score"))}</td><td>{_number(r.get("reward"))}</td>'
            f'<td>{esc(r.get("num_turns"))} / {esc(r.get("max_turns"))}</td>'
            f'<td>{esc(r.get("stop_reason"))}</td><td class="failure">{failure_cell}</td>'
            f'<td>{versions_text(entry)}</td><td>{step_link(index.trained_step(entry), r)}</td>'
            f'<td>{compare}</td></tr>')


EPISODE_COLUMNS = ("recorded", "episode", "env", "task", "outcome", "score", "reward", "turns", "stop", "failure",
                   "policy", "trained at", "")


def episode_table(rows: Iterable[str], poll_url: str = "", latest: int = -1) -> str:
    rows = list(rows)
    poll = f' data-poll="{esc(poll_url)}" data-latest="{latest}"' if poll_url else ""
    head = "".join(f"<th>{esc(c)}</th>" for c in EPISODE_COLUMNS)
    empty = "" if rows else (f'<tr id="no-episodes"><td colspan="{len(EPISODE_COLUMNS)}" class="muted">'
                             "no episodes match (yet)</td></tr>")
    return (f'<table class="episodes" id="episodes"{poll}><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}{empty}</tbody></table>')


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return esc(value)


def _select(name: str, options: Iterable[tuple[str, str]], chosen: str) -> str:
    items = "".join(f'<option value="{esc(v)}"{" selected" if v == chosen else ""}>{esc(label)}</option>'
                    for v, label in options)
    return f'<select name="{name}" id="filter-{name}">{items}</select>'


def _number_input(name: str, value: int | None, placeholder: str) -> str:
    shown = "" if value is None else str(value)
    return (f'<input type="number" name="{name}" id="filter-{name}" value="{esc(shown)}" '
            f'placeholder="{placeholder}" min="0">')


def _range(label: str, name: str, low: int | None, high: int | None) -> str:
    return (f'<label>{label} <span class="pair">{_number_input(f"{name}_min", low, "from")}–'
            f'{_number_input(f"{name}_max", high, "to")}</span></label>')


def filter_form(flt: EpisodeFilter, index: EpisodeIndex) -> str:
    envs = [("", "any")] + [(e, e) for e in index.env_names()]
    if flt.env and flt.env not in index.env_names():
        envs.append((flt.env, flt.env))
    failures = [("", "any"), (FAILURE_NONE, "no failure"), (FAILURE_ANY, "any failure")] + \
        [(k, k) for k in sorted(index.failure_kinds | ({flt.failure} - {"", FAILURE_NONE, FAILURE_ANY}))]
    outcomes = [("", "any"), ("success", "success"), ("failed", "failed")]
    kinds = [("", "all"), ("training", "training"), ("evaluation", "evaluation")]
    errors = "".join(f"<p class='errors'>{esc(e)}</p>" for e in flt.errors)
    return f"""{errors}<form class="filters" id="filters" method="get" action="/">
<label>Environment {_select("env", envs, flt.env)}</label>
<label>Task id <input type="text" name="task" id="filter-task" value="{esc(flt.task)}" size="6"></label>
<label>Outcome {_select("outcome", outcomes, flt.outcome)}</label>
<label>Failure kind {_select("failure", failures, flt.failure)}</label>
<label>Episodes {_select("kind", kinds, flt.kind)}</label>
{_range("Learner step", "step", flt.step_min, flt.step_max)}
{_range("Turns", "turns", flt.turns_min, flt.turns_max)}
{_range("Policy version", "version", flt.version_min, flt.version_max)}
<label>Search <input type="search" name="q" id="filter-q" value="{esc(flt.q)}" placeholder="words in the texts"></label>
<button type="submit" id="apply-filters">Filter</button> <a href="/">clear</a>
</form>"""


def summary_text(entries: list[Entry]) -> str:
    n = len(entries)
    successes = sum(1 for e in entries if e.record.get("success"))
    failures = Counter(e.record.get("failure") for e in entries if e.record.get("failure"))
    parts = [f'<span id="total">{n}</span> episodes match']
    if n:
        parts.append(f"{successes} successful ({100 * successes / n:.0f}%)")
    if failures:
        parts.append("failures: " + ", ".join(f"{esc(k)} {v}" for k, v in sorted(failures.items())))
    return '<p class="summary">' + " · ".join(parts) + "</p>"


# ------------------------------------------------------------------ pages
def list_page(index: EpisodeIndex, flt: EpisodeFilter, offset: int, run_label: str) -> str:
    matching = index.select(flt)
    shown = matching[offset: offset + PAGE_SIZE]
    rows = [episode_row(e, index) for e in shown]
    # Only the first page follows the run: new episodes belong at its top.
    poll = "/api/episodes?" + urlencode({**flt.query(), "format": "rows"}) if offset == 0 else ""
    pages = []
    if offset > 0:
        newer = list_url(**flt.query(), offset=max(0, offset - PAGE_SIZE) or None)
        pages.append(f'<a href="{esc(newer)}">← newer</a>')
    if offset + PAGE_SIZE < len(matching):
        pages.append(f'<a href="{esc(list_url(**flt.query(), offset=offset + PAGE_SIZE))}">older →</a>')
    position = (f'<span class="muted">showing {offset + 1}–{offset + len(shown)} of {len(matching)}</span>'
                if matching else "")
    body = (f"<h1>Episodes</h1>{filter_form(flt, index)}{summary_text(matching)}"
            f"{episode_table(rows, poll, index.latest_seq)}<nav class='pages'>{position}{''.join(pages)}</nav>")
    return layout("Episodes", body, run_label, "list")


def _facts(entry: Entry, index: EpisodeIndex) -> str:
    r = entry.record
    step = index.trained_step(entry)
    group = r.get("group_id", "")
    failure = ""
    if r.get("failure"):
        failure = (f'<dt>failure</dt><dd><span class="bad">{esc(r["failure"])}</span> '
                   f'<span class="small">{esc(r.get("failure_message"))}</span></dd>')
    _, full = when(r)
    branched = _samples_text(r)
    return f"""<dl class="facts">
<dt>environment</dt><dd>{esc(r.get("env"))}</dd>
<dt>task</dt><dd>{esc(r.get("task_id"))} <span class="small">{esc(r.get("category"))}</span>
  · <a href="{esc(list_url(env=r.get("env"), task=r.get("task_id")))}">all episodes of this task</a></dd>
<dt>outcome</dt><dd>{outcome_html(r)} · score {_number(r.get("score"))} · reward {_number(r.get("reward"))}</dd>
<dt>turns</dt><dd>{esc(r.get("num_turns"))} of at most {esc(r.get("max_turns"))}
  · stopped: {esc(r.get("stop_reason"))}{branched}</dd>
{failure}<dt>policy</dt><dd>{versions_text(entry)}</dd>
<dt>trained at</dt><dd>{step_link(step, r)}</dd>
<dt>group</dt><dd><a href="{esc(list_url(q=group))}">{esc(group)}</a></dd>
<dt>recorded</dt><dd>{esc(full)} · actor {esc(r.get("actor_id"))} · run {esc(r.get("run_id"))}</dd>
</dl>"""


def _samples_text(record: dict[str, Any]) -> str:
    """An episode whose chat template rewrites history, or that went on past the context in windows or summaries,
    trains as several sequences (docs/episodes.md): how many, and why."""
    samples = record.get("samples", 1)
    if samples <= 1:
        return ""
    summaries = sum(1 for t in record.get("turns", []) if t.get("summary"))
    windows = sum(1 for hidden in record.get("hidden_turns", [])[1:] if hidden) - summaries
    parts = [f"{n} {one if n == 1 else many}" for n, one, many in
             ((windows, "context window", "context windows"), (summaries, "context summary", "context summaries"))
             if n > 0]
    return f" · trained as {esc(samples)} samples ({' and '.join(parts) or 'the template rewrites history'})"


def _running_rewards(record: dict[str, Any]) -> list[float]:
    """The return so far at each position (0 = before any turn)."""
    total, out = 0.0, [0.0]
    for turn in record.get("turns", []):
        total += float(turn.get("reward") or 0.0)
        out.append(total)
    return out


def _state_html(entry: Entry, position: int, replay: Replay | None, current: bool, returns: list[float]) -> str:
    """What the environment's state looked like at ``position``, beside the texts."""
    r = entry.record
    env = r.get("env")
    if env == "babyai":
        if replay is not None and position < replay.reproduced:
            src = frame_url(entry.key, position)
            attr = f'src="{esc(src)}"' if current else f'data-src="{esc(src)}"'
            caption = "start" if position == 0 else f"after turn {position}"
            return (f'<figure><img class="frame" {attr} alt="BabyAI grid, {caption}">'
                    f'<figcaption class="small">{caption}</figcaption></figure>')
        return f'<p class="no-state">No grid: {esc(replay.problem if replay else "not replayed")}</p>'
    if env == "textcraft":
        if replay is not None and position < replay.reproduced:
            inventory = replay.inventories[position]
            rows = "".join(f"<tr><td>{esc(item)}</td><td>{count}</td></tr>" for item, count in inventory.items())
            rows = rows or '<tr><td colspan="2" class="muted">empty</td></tr>'
            return (f'<table class="inventory"><caption>Inventory</caption><tr><th>item</th><th>count</th></tr>'
                    f"{rows}</table>")
        return f'<p class="no-state">No inventory: {esc(replay.problem if replay else "not replayed")}</p>'
    if env == "sciworld":
        return f'<p class="score">Score <b>{100 * returns[position]:.0f}</b> / 100</p>'
    return f'<p class="score">Return so far <b>{returns[position]:.3g}</b></p>'


def _segment_note(record: dict[str, Any], position: int) -> str:
    """Above the first turn of each sample after the first: where the new sequence starts and what its prompt
    leaves out (a context window), or that the template re-rendered the history."""
    turns = record.get("turns", [])
    sample = turns[position - 1].get("sample", 0)
    if sample == 0 or (position > 1 and turns[position - 2].get("sample", 0) == sample):
        return ""
    hidden = (record.get("hidden_turns") or [])[sample:sample + 1] or [0]
    shown = f"turns {hidden[0] + 1}–{position - 1}" if hidden[0] < position - 1 else "the last observation"
    if position > 1 and turns[position - 2].get("summary"):
        what = f"its prompt is the task, the summary of turn {position - 1} and the latest observation; turns " \
               f"1–{position - 1} are not shown (context summary)"
    elif hidden[0]:
        what = f"its prompt shows the task and {shown}; turns 1–{hidden[0]} are not shown (context window)"
    else:
        what = "its prompt is the history as the template renders it"
    return f'<p class="segment small">New sample {sample + 1}: {what}.</p>'


def replay_html(entry: Entry, replay: Replay | None, current: int) -> str:
    r = entry.record
    turns = r.get("turns", [])
    returns = _running_rewards(r)
    sections = []
    for position in range(len(turns) + 1):
        state = _state_html(entry, position, replay, position == current, returns)
        if position == 0:
            text = (f'<h3>Start</h3><h4>Task (first observation)</h4>'
                    f'<pre class="observation">{esc(r.get("first_observation"))}</pre>')
        else:
            turn = turns[position - 1]
            action = (f'<code>{esc(turn.get("action"))}</code>' if turn.get("action")
                      else '<span class="muted">(the reply names no action)</span>')
            if turn.get("observation") is None:
                answer = f'<p class="bad">no answer: the episode failed here ({esc(r.get("failure"))})</p>'
            else:
                answer = f'<pre class="observation">{esc(turn.get("observation"))}</pre>'
            heading = f"Turn {position}: the model's summary (no environment step)" if turn.get("summary") \
                else f"Turn {position}"
            text = (f'{_segment_note(r, position)}'
                    f'<h3>{esc(heading)}</h3><p class="small">policy v{esc(turn.get("version"))} '
                    f'(epoch {esc(turn.get("epoch"))}) · reward {_number(turn.get("reward"))}</p>'
                    f'<h4>Reply</h4><pre class="reply">{esc(turn.get("reply"))}</pre>'
                    f'<h4>Action</h4><p class="action">{action}</p><h4>Environment</h4>{answer}')
        if position == len(turns) and r.get("failure"):
            text += (f'<p class="bad">The episode failed: {esc(r.get("failure"))} '
                     f'<span class="small">{esc(r.get("failure_message"))}</span></p>')
        klass = "position current" if position == current else "position"
        sections.append(f'<section class="{klass}" data-position="{position}"><div class="state">{state}</div>'
                        f'<div class="text">{text}</div></section>')
    note = ""
    if replay is not None and replay.problem:
        note = f'<p class="small muted replay-note">Replay: {esc(replay.problem)}</p>'
    ended = f'<p class="ended small muted" hidden>this episode ended at turn {len(turns)}</p>'
    return f'<div class="replay" data-episode="{esc(entry.key)}">{note}{ended}{"".join(sections)}</div>'


def stepper_html(current: int, last: int) -> str:
    def link(id_: str, target: int, label: str, disabled: bool) -> str:
        target = min(max(0, target), last)
        klass = ' class="disabled"' if disabled else ""
        return f'<a id="{id_}" href="?turn={target}"{klass}>{label}</a>'

    where = f"Start (turn 0 of {last})" if current == 0 else f"Turn {current} of {last}"
    return (f'<div class="stepper" data-current="{current}">'
            f'{link("first", 0, "« first", current == 0)}{link("prev", current - 1, "◀ prev", current == 0)}'
            f'<span id="position">{where}</span>'
            f'{link("next", current + 1, "next ▶", current >= last)}{link("last", last, "last »", current >= last)}'
            f'<button type="button" id="show-all">show all turns</button>'
            f'<span class="small muted">← → keys step</span></div>')


def episode_page(entry: Entry, index: EpisodeIndex, replay: Replay | None, turn: int, run_label: str) -> str:
    r = entry.record
    last = len(r.get("turns", []))
    current = min(max(0, turn), last)
    links = []
    if index.early_and_late(r.get("env", ""), r.get("task_id")) is not None:
        links.append(f'<a id="compare-link" href="{esc(compare_url(r.get("env", ""), r.get("task_id")))}">'
                     "this task early vs late in training</a>")
    links.append(f'<a href="/api/episode/{quote(entry.key, safe="")}">the record (JSON)</a>')
    body = (f"<h1>Episode <code>{esc(entry.key)}</code></h1>{_facts(entry, index)}"
            f"<p>{' · '.join(links)}</p>{stepper_html(current, last)}{replay_html(entry, replay, current)}")
    return layout(f"Episode {entry.key}", body, run_label, "episode")


def steps_page(index: EpisodeIndex, run_label: str) -> str:
    rows = []
    for step in reversed(index.steps()):
        groups = index.step_groups[step]
        episodes = index.trained_at(step)
        recorded_groups = {e.record.get("group_id") for e in episodes}
        successes = sum(1 for e in episodes if e.record.get("success"))
        rate = f"{100 * successes / len(episodes):.0f}%" if episodes else "—"
        rows.append(f'<tr><td><a href="/step/{step}">step {step}</a></td><td>{len(groups)}</td>'
                    f"<td>{len(recorded_groups)}</td><td>{len(episodes)}</td><td>{rate}</td></tr>")
    table = ('<table class="plain" id="steps"><thead><tr><th>learner step</th><th>groups trained on</th>'
             "<th>groups recorded</th><th>episodes recorded</th><th>their success</th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>" if rows else
             '<p class="muted">No learner step has trained on a batch yet (evaluation records have none).</p>')
    body = ("<h1>Learner steps</h1><p class='small muted'>Each step trained on a batch of GRPO groups; the "
            "buffer records a share of groups (monitor.record_fraction), so a step may list fewer groups "
            f"here than it trained on.</p>{table}")
    return layout("Learner steps", body, run_label, "steps")


def step_page(step: int, index: EpisodeIndex, run_label: str) -> str:
    groups = index.step_groups.get(step, set())
    episodes = index.trained_at(step)
    recorded = {e.record.get("group_id") for e in episodes}
    steps = index.steps()
    nav = []
    earlier = [s for s in steps if s < step]
    later = [s for s in steps if s > step]
    if earlier:
        nav.append(f'<a href="/step/{earlier[-1]}">← step {earlier[-1]}</a>')
    if later:
        nav.append(f'<a href="/step/{later[0]}">step {later[0]} →</a>')
    body = (f"<h1>Learner step {step}</h1><p>Trained on {len(groups)} groups; {len(recorded)} of them recorded "
            f"({len(episodes)} episodes). <a href='{esc(list_url(step_min=step, step_max=step))}'>Filter the "
            f"list to them</a></p><nav class='pages'>{''.join(nav)}</nav>"
            f"{summary_text(episodes)}{episode_table(episode_row(e, index) for e in episodes)}")
    return layout(f"Learner step {step}", body, run_label, "step")


def compare_index_page(index: EpisodeIndex, run_label: str) -> str:
    rows = []
    for (env, task_id), (early, late) in index.tasks_seen_at_several_versions():
        entries = index.task_episodes(env, task_id)
        successes = sum(1 for e in entries if e.record.get("success"))
        rows.append(f'<tr><td>{esc(env)}</td><td>{esc(task_id)} <span class="small">'
                    f'{esc(early.record.get("category"))}</span></td><td>{len(entries)}</td><td>{successes}</td>'
                    f"<td>{versions_text(early)} {outcome_html(early.record)}</td>"
                    f"<td>{versions_text(late)} {outcome_html(late.record)}</td>"
                    f'<td><a href="{esc(compare_url(env, task_id))}">early vs late</a></td></tr>')
    table = ('<table class="plain" id="tasks"><thead><tr><th>env</th><th>task</th><th>episodes</th>'
             "<th>successful</th><th>earliest</th><th>latest</th><th></th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>" if rows else
             '<p class="muted">No task has been recorded at two policy versions yet.</p>')
    body = ("<h1>The same task early vs late in training</h1><p class='small muted'>Tasks recorded at more than "
            "one policy version: the episode played by the earliest weights and the one by the latest, the "
            f"widest span first.</p>{table}")
    return layout("Early vs late", body, run_label, "compare-index")


def _episode_choice(name: str, entries: list[Entry], chosen: Entry) -> str:
    options = [(e.key, f"{e.key} · {versions_text(e)} · {'success' if e.record.get('success') else 'failed'} · "
                       f"{e.record.get('num_turns')} turns") for e in entries]
    return _select(name, options, chosen.key)


def compare_page(index: EpisodeIndex, env: str, task_id: Any, left: Entry, right: Entry,
                 replays: tuple[Replay | None, Replay | None], turn: int, run_label: str) -> str:
    entries = index.task_episodes(env, task_id)
    last = max(len(left.record.get("turns", [])), len(right.record.get("turns", [])))
    current = min(max(0, turn), last)
    sides = []
    for label, entry, replay in (("Earlier", left, replays[0]), ("Later", right, replays[1])):
        r = entry.record
        step = index.trained_step(entry)
        sides.append(f'<div class="side"><h2>{label}: policy {versions_text(entry)}</h2>'
                     f'<p><a href="{esc(episode_url(entry.key))}">{esc(entry.key)}</a> · {outcome_html(r)} · '
                     f'score {_number(r.get("score"))} · {esc(r.get("num_turns"))} turns · '
                     f'{step_link(step, r)}</p>{replay_html(entry, replay, current)}</div>')
    form = (f'<form class="filters" method="get" action="/compare">'
            f'<input type="hidden" name="env" value="{esc(env)}">'
            f'<input type="hidden" name="task" value="{esc(task_id)}">'
            f'<label>Earlier {_episode_choice("a", entries, left)}</label>'
            f'<label>Later {_episode_choice("b", entries, right)}</label><button type="submit">Compare</button></form>')
    category = left.record.get("category") or ""
    body = (f"<h1>{esc(env)} task {esc(task_id)} <span class='small'>{esc(category)}</span>: early vs late</h1>"
            f"{form}{stepper_html(current, last)}<div class='sides'>{''.join(sides)}</div>")
    return layout(f"{env} task {task_id}: early vs late", body, run_label, "compare")


def message_page(title: str, message: str, run_label: str) -> str:
    return layout(title, f"<h1>{esc(title)}</h1><p>{esc(message)}</p><p><a href='/'>all episodes</a></p>",
                  run_label, "message")
