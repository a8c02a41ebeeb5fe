"""Chromium's accessibility tree (CDP ``Accessibility.getFullAXTree``) as WebArena's text.

One node per line, ``[id] role 'name' prop: value ...``, indented by one tab per printed
ancestor. The pruning follows WebArena's rules, re-implemented here:

- a node without a name, or marked ignored, is not printed (its children still are, one level up);
- ``focusable``, ``editable``, ``readonly``, ``level``, ``settable``, ``multiline`` and ``invalid``
  are never printed; nor are properties whose value is false or empty (a simplification of ours);
- a nameless ``generic``/``img``/``list``/``strong``/``paragraph``/``banner``/``navigation``/
  ``Section``/``LabelText``/``Legend``/``listitem`` node without properties is not printed, nor a
  nameless ``listitem`` at all;
- with ``viewport_only`` a node whose layout box lies outside the viewport (or that has no box) is
  not printed (WebArena's ``current_viewport_only``);
- a ``StaticText`` line whose text already appears in one of the three lines above it is dropped.

Ids are numbered 1, 2, ... in print order, so the same page gives the same text in every process;
``Snapshot.nodes`` maps each id to the DOM node (CDP ``backendDOMNodeId``) actions target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IGNORED_PROPERTIES = frozenset({"focusable", "editable", "readonly", "level", "settable", "multiline", "invalid"})
NAMELESS_UNPRINTED = frozenset({"generic", "img", "list", "strong", "paragraph", "banner", "navigation", "Section",
                                "LabelText", "Legend", "listitem", "none", "presentation"})
TEXT_ROLES = frozenset({"StaticText"})


@dataclass(frozen=True)
class Node:
    role: str
    name: str
    backend_id: int | None


@dataclass
class Snapshot:
    text: str
    nodes: dict[int, Node] = field(default_factory=dict)


Box = tuple[float, float, float, float]  # x, y, width, height in document coordinates


def render_tree(ax_nodes: list[dict[str, Any]], boxes: dict[int, Box] | None = None,
                viewport: Box | None = None, link_urls: bool = True) -> Snapshot:
    """The WebArena text of a CDP AX tree; ``boxes`` (backend id -> box) and ``viewport`` prune to
    what is on screen when both are given."""
    by_id = {n["nodeId"]: n for n in ax_nodes}
    if not ax_nodes:
        return Snapshot("")
    root = next((n for n in ax_nodes if not n.get("parentId")), ax_nodes[0])
    lines: list[tuple[int, str, Node]] = []  # depth, line without id, node

    def visible(node: dict[str, Any]) -> bool:
        if boxes is None or viewport is None or node.get("role", {}).get("value") == "RootWebArea":
            return True
        box = boxes.get(node.get("backendDOMNodeId", -1))
        if box is None:
            return False
        x, y, w, h = box
        vx, vy, vw, vh = viewport
        return w > 0 and h > 0 and x < vx + vw and x + w > vx and y < vy + vh and y + h > vy

    stack: list[tuple[str, int]] = [(root["nodeId"], 0)]
    while stack:
        node_id, depth = stack.pop()
        node = by_id.get(node_id)
        if node is None:
            continue
        printed = False
        if not node.get("ignored") and "name" in node and visible(node):
            role = str(node.get("role", {}).get("value", ""))
            name = str(node["name"].get("value", ""))
            props = []
            for prop in node.get("properties", []):
                key, value = prop.get("name"), prop.get("value", {}).get("value")
                if key in IGNORED_PROPERTIES or value in (None, False, "", "false") or (key == "url" and not link_urls):
                    continue
                props.append(f"{key}: {value}")
            nameless = not name.strip()
            if not (nameless and ((role in NAMELESS_UNPRINTED and not props) or role == "listitem"
                                  or role in TEXT_ROLES or role == "InlineTextBox")):
                line = f"{role} {name!r}" + (" " + " ".join(props) if props else "")
                lines.append((depth, line, Node(role, name, node.get("backendDOMNodeId"))))
                printed = True
        child_depth = depth + 1 if printed else depth
        for child in reversed(node.get("childIds", [])):
            stack.append((child, child_depth))

    out: list[str] = []
    nodes: dict[int, Node] = {}
    recent: list[str] = []
    for depth, line, node in lines:
        if node.role in TEXT_ROLES and any(node.name.strip() in previous for previous in recent[-3:]):
            continue
        recent.append(line)
        nid = len(nodes) + 1
        nodes[nid] = node
        out.append("\t" * depth + f"[{nid}] {line}")
    return Snapshot("\n".join(out), nodes)


def layout_boxes(snapshot: dict[str, Any]) -> dict[int, Box]:
    """Backend node id -> layout box from CDP ``DOMSnapshot.captureSnapshot`` (main document)."""
    if not snapshot.get("documents"):
        return {}
    doc = snapshot["documents"][0]
    backend = doc["nodes"]["backendNodeId"]
    layout = doc["layout"]
    boxes: dict[int, Box] = {}
    for index, bounds in zip(layout["nodeIndex"], layout["bounds"]):
        bid = backend[index]
        x, y, w, h = bounds
        if bid in boxes:  # text split over several boxes: their union
            ox, oy, ow, oh = boxes[bid]
            nx, ny = min(ox, x), min(oy, y)
            boxes[bid] = (nx, ny, max(ox + ow, x + w) - nx, max(oy + oh, y + h) - ny)
        else:
            boxes[bid] = (x, y, w, h)
    return boxes


def truncate(text: str, max_chars: int) -> tuple[str, int]:
    """The first lines of ``text`` within ``max_chars`` and how many lines were cut."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text, 0
    lines, size, kept = text.split("\n"), 0, []
    for line in lines:
        if size + len(line) + 1 > max_chars:
            break
        kept.append(line)
        size += len(line) + 1
    return "\n".join(kept), len(lines) - len(kept)

