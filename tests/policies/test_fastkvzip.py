"""Fast KVzip (--method fastkvzip): trained gates on the hidden states rank the model's tokens as KVzip does."""

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import assert_refused_when_configured, greedy, random_prompt, replace_for, tiny_model

from restkv import CompressionConfig, ConfigError
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.policies.fastkvzip import GATE_PARAMETERS, gate_scores, gates_of


def random_gates(layers=3, hidden=64, heads=2, groups=2, width=16, sinks=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q_proj.weight": (heads * groups * width, hidden), "q_proj.bias": (heads * groups * width,),
              "k_proj.weight": (heads * width, hidden), "q_norm.weight": (width,), "k_norm.weight": (width,),
              "k_base": (heads, 1, sinks, width), "b": (heads, 1, groups)}
    return [{name: torch.randn(*shapes[name], generator=generator) * 0.3 for name in GATE_PARAMETERS}
            for _ in range(layers)]


def test_the_authors_pt_and_a_safetensors_file_hold_the_same_gates(tmp_path):
    gates = random_gates()
    torch.save({"module": gates}, tmp_path / "q2_dim16_sink16.pt")
    save_file({f"gate{layer}.{name}": t.contiguous() for layer, gate in enumerate(gates) for name, t in gate.items()},
              str(tmp_path / "gates.safetensors"))
    for path in ("q2_dim16_sink16.pt", "gates.safetensors"):
        loaded = gates_of(str(tmp_path / path))
        assert len(loaded) == 3 and all(torch.equal(loaded[1][name], gates[1][name]) for name in GATE_PARAMETERS)


def test_a_gate_score_is_how_much_a_query_reads_the_token_rather_than_the_sinks():
    """One head, one query, one sink: score = 1 / (1 + exp(q.k_s / 4 - q.k / 4 - b))."""
    gate = random_gates(layers=1, hidden=8, heads=1, groups=1, sinks=1)[0]
    hidden = torch.randn(1, 5, 8)

    def rms(x, w):
        return w * x / (x.square().mean(dim=-1, keepdim=True) + 1e-6).sqrt()

    query = rms(hidden[0] @ gate["q_proj.weight"].T + gate["q_proj.bias"], gate["q_norm.weight"])
    key = rms(hidden[0] @ gate["k_proj.weight"].T, gate["k_norm.weight"])
    expected = 1 / (1 + torch.exp((query @ gate["k_base"][0, 0, 0]) / 4 - (query * key).sum(-1) / 4 - gate["b"][0, 0, 0]))
    torch.testing.assert_close(gate_scores(gate, hidden)[0, 0], expected, rtol=1e-5, atol=1e-6)


def test_fastkvzip_keeps_the_models_budget_across_layers(tmp_path):
    torch.save({"module": random_gates()}, tmp_path / "gates.pt")
    replace_for("llama")(method="fastkvzip", max_capacity_prompts=20, window_size=2,
                         fastkvzip_gates=str(tmp_path / "gates.pt"))
    cache = output_cache(greedy(tiny_model("llama"), random_prompt(1, 60), new_tokens=1))
    counts = [len(head) for layer in kept_positions(cache) for head in layer.exact[0]]
    assert sum(counts) == 3 * 2 * 20 and len(set(counts)) > 1
    assert all(head[:4] == [0, 1, 2, 3] and head[-2:] == [58, 59] for layer in kept_positions(cache)
               for head in layer.exact[0])


def test_fastkvzip_needs_its_gates(tmp_path):
    with pytest.raises(ConfigError, match="--method fastkvzip needs --fastkvzip_gates FILE"):
        CompressionConfig(method="fastkvzip", max_capacity_prompts=20, window_size=2)
    torch.save({"module": [{"b": torch.zeros(2, 1, 2)}]}, tmp_path / "half.pt")
    with pytest.raises(ConfigError, match="--fastkvzip_gates .* must hold, per layer, q_proj.weight"):
        CompressionConfig(method="fastkvzip", max_capacity_prompts=20, window_size=2,
                          fastkvzip_gates=str(tmp_path / "half.pt"))


@pytest.mark.parametrize("shape, message", [
    (dict(hidden=32), r"gate0.q_proj.weight is \[64, 32\]; the model needs \[64, 64\]"),
    (dict(groups=1), r"gate0.q_proj.weight is \[32, 64\]; the model needs \[64, 64\]"),
    (dict(heads=4), "holds 3 gates of 4 KV heads; the model has 3 layers of 2"),
])
def test_gates_of_another_model_are_refused_when_the_model_is_configured(tmp_path, shape, message):
    torch.save({"module": random_gates(**shape)}, tmp_path / "other.pt")
    assert_refused_when_configured(dict(method="fastkvzip", max_capacity_prompts=20, window_size=2,
                                        fastkvzip_gates=str(tmp_path / "other.pt")),
                                   f"--fastkvzip_gates .*other.pt.*{message}")


def test_gates_that_are_no_gates_are_refused_when_the_config_is_built(tmp_path):
    def refused(gates, message):
        torch.save({"module": gates}, tmp_path / "bad.pt")
        with pytest.raises(ConfigError, match=f"--fastkvzip_gates .*bad.pt.*{message}"):
            CompressionConfig(method="fastkvzip", max_capacity_prompts=20, window_size=2,
                              fastkvzip_gates=str(tmp_path / "bad.pt"))

    refused([{name: 1.0 for name in GATE_PARAMETERS}] * 3, "q_proj.weight must be a tensor of floating-point numbers")
    gates = random_gates()
    gates[2]["k_base"] = torch.full((2, 1, 16, 16), float("nan"))
    refused(gates, "k_base holds NaN")
    gates = random_gates()
    gates[1]["k_norm.weight"] = torch.ones(8)
    refused(gates, r"gate1.k_norm.weight is \[8\]; gate 0 makes it \[16\]")
    (tmp_path / "bad.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="--fastkvzip_gates .*bad.pt.* cannot be read"):
        CompressionConfig(method="fastkvzip", max_capacity_prompts=20, window_size=2,
                          fastkvzip_gates=str(tmp_path / "bad.pt"))
