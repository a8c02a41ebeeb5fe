"""LoRA on the policy (learner/lora.py, core/adapter_format.py, actors/lora_adapter.py's file side): the layer's
equation, which parameters train, the merge, the adapter as the engines get it and as a checkpoint keeps it.
No process group, no engine: the FSDP step is tests/learner/test_lora_step.py, the live engine
tests/integration/test_lora_engine.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from horizonrl.core.adapter_format import (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapted_module, adapter_config,
                                           is_adapter_tensor, parameter_name, peft_name, wire_adapter_config)
from horizonrl.learner.lora import (LoRALinear, LoraSettings, adapter_tensors, adapter_to_send, add_lora,
                                    initial_adapter, merged_state_dict, save_adapter)

SETTINGS = LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def with_adapters(model, settings: LoraSettings = SETTINGS, seed: int = 0):
    """``model`` with adapters added and given their first values, then B set to random values (a trained
    adapter: at B = 0 every check below would hold trivially)."""
    add_lora(model, settings)
    initial = initial_adapter(model, seed)
    model.load_state_dict(initial, strict=False)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def test_lora_linear_adds_the_scaled_low_rank_update():
    torch.manual_seed(0)
    layer = LoRALinear(6, 5, bias=True, rank=2, alpha=3.0)
    x = torch.randn(4, 6)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    delta = 1.5 * layer.lora_B.weight @ layer.lora_A.weight  # s = α / r = 3 / 2
    expected = x @ (layer.weight + delta).T + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_add_lora_keeps_the_base_names_and_trains_only_the_adapters():
    model = tiny_qwen2()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    adapted = add_lora(model, SETTINGS)
    assert adapted == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj",
                                                                            "mlp.down_proj")]
    state = model.state_dict()
    for name, tensor in before.items():  # every base weight under its old name, the same tensor
        assert torch.equal(state[name], tensor), name
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{layer}.{factor}.weight" for layer in adapted for factor in ("lora_A", "lora_B"))
    assert model.model.layers[0].self_attn.q_proj.lora_A.weight.shape == (4, 64)
    assert model.model.layers[0].mlp.down_proj.lora_B.weight.shape == (64, 4)
    assert type(model.model.layers[0].self_attn.k_proj) is nn.Linear  # not a target


def test_a_target_that_names_no_linear_layer_is_refused():
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear layer.*'q_proj'"):
        add_lora(tiny_qwen2(), LoraSettings(4, 8.0, ("q_proj", "qkv")))


def test_adapters_work_on_the_meta_device():
    """The learner builds the model on the meta device, adds the adapters there, and rank 0 gives them their first
    values with the checkpoint's (model.build_sharded_model)."""
    from transformers import AutoModelForCausalLM

    config = tiny_qwen2().config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    add_lora(model, SETTINGS)
    assert model.model.layers[1].self_attn.v_proj.lora_A.weight.is_meta
    initial = initial_adapter(model, seed=3)
    assert not any(t.is_meta for t in initial.values()) and len(initial) == 12


def test_the_adapted_model_starts_as_the_base_model_and_its_first_values_are_seeded():
    base = tiny_qwen2()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = base(ids).logits
    model = tiny_qwen2()
    add_lora(model, SETTINGS)
    model.load_state_dict(initial_adapter(model, seed=7), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)  # B = 0: ΔW = 0 exactly
    again, other = initial_adapter(model, seed=7), initial_adapter(model, seed=8)
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.equal(again[a], initial_adapter(model, seed=7)[a]) and not torch.equal(again[a], other[a])
    assert float(again[a].abs().max()) <= 1 / 64 ** 0.5 and float(again[a].abs().max()) > 0
    assert not again["model.layers.0.self_attn.q_proj.lora_B.weight"].any()


def test_the_merged_model_computes_what_the_adapted_one_does():
    model = with_adapters(tiny_qwen2())
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        adapted_logits = model(ids).logits
    merged = merged_state_dict(model.state_dict(), SETTINGS)
    assert not any("lora_" in name for name in merged)
    plain = tiny_qwen2(seed=5)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, adapted_logits, rtol=1e-4, atol=1e-4)
        base_logits = tiny_qwen2()(ids).logits
    assert float((adapted_logits - base_logits).abs().max()) > 1e-2  # the adapter matters: the check can fail


def test_the_engines_get_the_adapter_with_the_scaling_in_b():
    model = with_adapters(tiny_qwen2())
    sent = dict(adapter_to_send(model, SETTINGS))
    state = model.state_dict()
    assert len(sent) == 12 and all(is_adapter_tensor(name) for name in sent)
    q = "model.layers.1.self_attn.q_proj"
    torch.testing.assert_close(sent[peft_name(f"{q}.lora_B.weight")], 2.0 * state[f"{q}.lora_B.weight"])  # s = 8/4
    assert torch.equal(sent[peft_name(f"{q}.lora_A.weight")], state[f"{q}.lora_A.weight"])
    assert all(not tensor.requires_grad for tensor in sent.values())
    # what the engine writes for it: alpha = r, so its scaling is 1 (the factor is in B already)
    config = wire_adapter_config({name: list(t.shape) for name, t in sent.items()})
    assert config["r"] == 4 and config["lora_alpha"] == 4.0
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    # ΔW from the wire equals the learner's s·BA
    delta = sent[peft_name(f"{q}.lora_B.weight")] @ sent[peft_name(f"{q}.lora_A.weight")]
    torch.testing.assert_close(delta, 2.0 * state[f"{q}.lora_B.weight"] @ state[f"{q}.lora_A.weight"])


def test_a_checkpoint_keeps_the_adapter_in_pefts_format(tmp_path):
    from safetensors.torch import load_file

    model = with_adapters(tiny_qwen2())
    save_adapter(tmp_path / "adapter", model.state_dict(), SETTINGS, base_model="/models/base")
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_FILE).read_text())
    assert config == adapter_config(4, 8.0, ["q_proj", "v_proj", "down_proj"], "/models/base")
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    saved = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS_FILE))
    assert saved.keys() == adapter_tensors(model.state_dict()).keys()
    name = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    assert torch.equal(saved[name], model.model.layers[0].mlp.down_proj.lora_B.weight)  # unscaled


def test_peft_names():
    name = "model.layers.3.self_attn.q_proj.lora_A.weight"
    assert peft_name(name) == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert parameter_name(peft_name(name)) == name
    assert adapted_module(peft_name(name)) == "model.layers.3.self_attn.q_proj"
    assert is_adapter_tensor(peft_name(name))
    assert not is_adapter_tensor(name)  # not PEFT's naming
    assert not is_adapter_tensor("model.layers.3.self_attn.q_proj.weight")
    assert not is_adapter_tensor("base_model.model.model.layers.3.self_attn.q_proj.weight")
    with pytest.raises(ValueError):
        parameter_name(name)


def test_an_adapter_version_with_mixed_ranks_is_refused():
    with pytest.raises(ValueError, match="one rank"):
        wire_adapter_config({peft_name("model.layers.0.a.q_proj.lora_A.weight"): [4, 8],
                             peft_name("model.layers.0.a.v_proj.lora_A.weight"): [2, 8]})


def test_the_engine_writes_a_received_version_as_an_adapter_directory(tmp_path):
    """What the vLLM worker does with an adapter version (actors/lora_adapter.py), short of vLLM's load: the tensors
    come as views into one receive buffer, as the weight stream hands them out."""
    from safetensors.torch import load_file

    from horizonrl.actors.lora_adapter import served_rank, write_adapter_version

    model = with_adapters(tiny_qwen2())
    sent = adapter_to_send(model, SETTINGS)
    flat = torch.cat([t.reshape(-1) for _, t in sent])  # one buffer, the tensors views into it
    views, offset = [], 0
    for name, tensor in sent:
        views.append((name, flat[offset: offset + tensor.numel()].view(tensor.shape)))
        offset += tensor.numel()
    shapes = write_adapter_version(tmp_path / "worker-0", views)
    flat.zero_()  # the next version overwrites the buffer: the files must hold copies
    written = load_file(str(tmp_path / "worker-0" / ADAPTER_WEIGHTS_FILE))
    for name, tensor in sent:
        assert torch.equal(written[name], tensor) and shapes[name] == list(tensor.shape)
    config = json.loads((tmp_path / "worker-0" / ADAPTER_CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 4.0
    with pytest.raises(ValueError, match="never both"):
        write_adapter_version(tmp_path / "other", [("model.embed_tokens.weight", torch.zeros(2, 2))])
    assert [served_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
