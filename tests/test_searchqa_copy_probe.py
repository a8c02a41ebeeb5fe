"""scripts/searchqa_copy_probe.py, which docs/learning.md quotes: it reads each probability where the model
predicts that name, and on a model that has learnt nothing no name stands out."""

from __future__ import annotations

from helpers import load_script


def test_an_untrained_model_gives_no_name_a_high_probability(tmp_path):
    from horizonrl.envs.searchqa import SearchQAEnv
    from horizonrl.apps.tiny_model import build_model, build_tokenizer

    settings = {"people": 40, "name_parts": 8, "topk": 1}
    env = SearchQAEnv(**settings)
    texts = [row["question"] for row in env.rows] + [row["golden_answers"][0] for row in env.rows]
    tokenizer = build_tokenizer(texts * 3 + ["<search> </search> <answer> </answer> <think> </think>"] * 20, 600)
    model = build_model(len(tokenizer), seed=0, layers=1, hidden=64)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    figures = load_script("searchqa_copy_probe").probe(str(tmp_path), settings, "test", questions=3)
    assert set(figures) == {"search_first", "answer_city", "answer_first", "answer_last", "greedy_city"}
    assert all(0.0 < figures[key] < 0.05 for key in ("search_first", "answer_city", "answer_first", "answer_last"))
    assert figures["greedy_city"] in (0.0, 1 / 3, 2 / 3, 1.0)
