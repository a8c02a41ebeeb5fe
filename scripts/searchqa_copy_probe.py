"""Does a SearchQA model copy names from its context? Teacher-forced probabilities at the two places it must.

    python scripts/searchqa_copy_probe.py MODEL_DIR [--config configs/searchqa_1hop.yaml] [--split test] \\
        [--questions 100]

For the first N 1-hop questions of the split, the model reads the question, a search for the person's full name
and the page it returns, and this prints the mean probability, under the model, of

- ``search_first``: the person's first name as the first token of its search (it is in the question);
- ``answer_city`` / ``answer_first`` / ``answer_last``: the city of birth (the right answer, on the page), the
  person's first name or surname (also on the page, and in the question) as the first token of its answer;
- ``greedy_city``: how often the city is the answer's most likely first token.

A model that does not copy spreads its probability over every name of that kind it knows (1/60 of a first name
with the corpus of ``name_parts: 60``). docs/learning.md ("SearchQA: held-out success from reading the page")
quotes these numbers before and after training.
"""

from __future__ import annotations

import argparse
import math

from horizonrl.core.chat import ChatTokenizer
from horizonrl.core.config import load_config
from horizonrl.envs.retrieval import format_information
from horizonrl.envs.searchqa import INSTRUCTION, SearchQAEnv
from horizonrl.apps.tiny_model import episode_ids

SEARCH = "<think>I should look this up.</think>\n<search> {} </search>"
ANSWER = "<think>I will guess.</think>\n<answer> {} </answer>"


def first_token(tokenizer, name: str) -> int:
    return tokenizer.encode(" " + name)[0]  # names follow a space in both the search and the answer


def after(ids: list[int], marker: list[int], start: int) -> int:
    """The position just after the first occurrence of ``marker`` at or after ``start``."""
    for i in range(start, len(ids) - len(marker) + 1):
        if ids[i:i + len(marker)] == marker:
            return i + len(marker)
    raise ValueError("marker not found")


def probe(model_dir: str, settings: dict, split: str, questions: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatTokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    env = SearchQAEnv(**{**settings, "hops": [1]})
    rows = [env.rows[task_id] for task_id in env.task_ids(split)][:questions]
    totals = dict.fromkeys(("search_first", "answer_city", "answer_first", "answer_last", "greedy_city"), 0.0)
    for row in rows:
        person, city = row["supporting_titles"][0], row["golden_answers"][0]
        first, last = person.split()[0], person.split()[-1]
        page = f"\n\n<information>{format_information(env.retriever.search_blocking(person, 1))}</information>\n\n"
        messages = [{"role": "user", "content": INSTRUCTION.format(question=row["question"])},
                    {"role": "assistant", "content": SEARCH.format(person)},
                    {"role": "user", "content": page},
                    {"role": "assistant", "content": ANSWER.format(city)}]
        ids, _ = episode_ids(chat, messages)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        search_at = after(ids, tokenizer.encode("<search>"), 0)
        answer_at = after(ids, tokenizer.encode("<answer>"), search_at)
        # The probabilities below are read where the model predicts these tokens: check that they are there.
        if (ids[search_at], ids[answer_at]) != (first_token(tokenizer, first), first_token(tokenizer, city)):
            raise ValueError(f"{model_dir}: the names are not tokenized after a space as this probe expects")
        totals["search_first"] += math.exp(logp[search_at - 1, first_token(tokenizer, first)].item())
        for key, name in (("answer_city", city), ("answer_first", first), ("answer_last", last)):
            totals[key] += math.exp(logp[answer_at - 1, first_token(tokenizer, name)].item())
        totals["greedy_city"] += float(logp[answer_at - 1].argmax().item() == first_token(tokenizer, city))
    return {key: value / len(rows) for key, value in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--config", default="configs/searchqa_1hop.yaml", help="the run's config: its searchqa "
                        "settings say which corpus")
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument("--questions", type=int, default=100)
    args = parser.parse_args()
    config = load_config(args.config)
    settings = next((dict(s.settings) for s in config.envs if s.name == "searchqa"), None)
    if settings is None:
        parser.error(f"{args.config} has no searchqa environment")
    result = probe(args.model_dir, settings, args.split, args.questions)
    print(f"{args.model_dir} ({args.split}, {args.questions} questions): "
          + ", ".join(f"{key} {value:.3f}" for key, value in result.items()))


if __name__ == "__main__":
    main()
