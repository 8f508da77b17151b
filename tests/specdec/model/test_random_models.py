"""Random models by configuration: names and seeds, the published Llama-3.2 config values, the
seeded weights (tried on a tiny architecture, built in milliseconds), and one real-shape
build (the 1B's first 2 layers, ~1.5 GB in fp32) served by our forward and by transformers'."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from specdec.errors import InvalidArgumentError
from specdec.model.chat import encode_chat
from specdec.model.llama import PagedLlama
from specdec.model.loader import LoadedModel, gguf_path_of, load_model, load_tokenizer, weights_fingerprint
from specdec.model.random_models import ARCHITECTURES, RandomArchitecture, RandomModelSpec, build_random_model
from specdec.model.tokenizer_info import TokenizerInfo

#: A Llama small enough to build in milliseconds, through the same code as the real ones.
TINY = RandomArchitecture(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=1024,
)


def tiny(seed: int = 0, num_layers: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    return build_random_model(TINY, seed, dtype=dtype, device="cpu", num_layers=num_layers)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# -- names -------------------------------------------------------------------------------


def test_names_carry_an_architecture_and_a_seed() -> None:
    assert RandomModelSpec.parse("random:llama-3.2-1b") == RandomModelSpec("llama-3.2-1b", 0)
    assert RandomModelSpec.parse("random:llama-3.2-3b:seed=7") == RandomModelSpec("llama-3.2-3b", 7)
    assert RandomModelSpec.parse("random:llama-3.2-1b").name == "random:llama-3.2-1b:seed=0"  # type: ignore[union-attr]
    assert RandomModelSpec.parse("smollm2-135m") is None
    assert RandomModelSpec.parse("meta-llama/Llama-3.2-1B") is None


@pytest.mark.parametrize(
    "name",
    ["random:", "random:llama-3.2-8b", "random:llama-3.2-1b:seed=", "random:llama-3.2-1b:seed=-1",
     "random:llama-3.2-1b:seed=x", "random:llama-3.2-1b:7", "random:llama-3.2-1b:seed=1:seed=2",
     f"random:llama-3.2-1b:seed={2**63}"],
)
def test_a_bad_random_name_is_a_clear_error(name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="random:"):
        RandomModelSpec.parse(name)
    with pytest.raises(InvalidArgumentError):
        load_model(name)


def test_weights_fingerprint_is_the_canonical_name_and_no_gguf_is_read() -> None:
    assert weights_fingerprint("random:llama-3.2-1b") == weights_fingerprint("random:llama-3.2-1b:seed=0")
    assert weights_fingerprint("random:llama-3.2-1b:seed=1") == "random:llama-3.2-1b:seed=1"
    assert weights_fingerprint("random:llama-3.2-3b") != weights_fingerprint("random:llama-3.2-1b")
    assert gguf_path_of("random:llama-3.2-1b") is None


# -- the published configs ---------------------------------------------------------------


def test_the_architectures_are_llama_3_2_1b_and_3b() -> None:
    shared = dict(
        vocab_size=128_256, rms_norm_eps=1e-5, max_position_embeddings=131_072, bos_token_id=128_000,
        eos_token_id=[128_001, 128_008, 128_009], hidden_act="silu", initializer_range=0.02,
        tie_word_embeddings=True, model_type="llama",
    )
    own = {
        "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64),
        "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                             num_attention_heads=24, num_key_value_heads=8, head_dim=128),
    }
    assert set(ARCHITECTURES) == set(own)
    for name, values in own.items():
        config = ARCHITECTURES[name].config()
        assert {key: getattr(config, key) for key in {**shared, **values}} == {**shared, **values}, name
        assert config.rope_parameters == {
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        }
        assert ARCHITECTURES[name].config(num_layers=2).num_hidden_layers == 2


# -- seeded weights (tiny architecture) ----------------------------------------------------


def test_same_seed_same_weights_and_another_seed_other_weights() -> None:
    first, again, other = weights(tiny(seed=3)), weights(tiny(seed=3)), weights(tiny(seed=4))
    assert first.keys() == again.keys() == other.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(tensor, other[name]), name


def test_llama_initialisation_with_a_tied_head_and_its_rope() -> None:
    model = tiny()
    for name, tensor in weights(model).items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert abs(float(tensor.std()) - TINY.initializer_range) < 0.004, name
            assert abs(float(tensor.mean())) < 0.003, name
    assert model.lm_head.weight is model.model.embed_tokens.weight
    reference = type(model.model.rotary_emb)(TINY.config())
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.inv_freq)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 and not model.training


def test_first_layers_alone_are_the_full_builds_first_layers() -> None:
    full, first = weights(tiny()), weights(tiny(num_layers=2))
    assert not any(".layers.2." in name for name in first)
    for name, tensor in first.items():
        assert torch.equal(tensor, full[name]), name


def test_a_bfloat16_build_holds_the_float32_weights_rounded() -> None:
    fp32, bf16 = weights(tiny()), weights(tiny(dtype=torch.bfloat16))
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name


def test_layer_count_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        tiny(num_layers=4)
    with pytest.raises(InvalidArgumentError, match="num_layers"):
        load_model("random:llama-3.2-1b", num_layers=17)


# -- the real shapes: Llama-3.2-1B's first 2 layers --------------------------------------


@pytest.fixture(scope="module")
def random_1b() -> Iterator[LoadedModel]:
    yield load_model("random:llama-3.2-1b:seed=5", num_layers=2)


def test_a_random_model_loads_by_name(random_1b: LoadedModel) -> None:
    assert random_1b.model_id == "random:llama-3.2-1b:seed=5"
    assert random_1b.name == "random:llama-3.2-1b:seed=5 (first 2 layers)"
    assert len(random_1b.model.model.layers) == random_1b.model.config.num_hidden_layers == 2
    assert random_1b.model.model.embed_tokens.weight.shape == (128_256, 2048)
    assert random_1b.model.dtype == torch.float32


def test_our_forward_matches_transformers_on_the_random_1b(random_1b: LoadedModel) -> None:
    """A batched prefill of two prompts of different lengths, then two batched decode steps."""
    model, tokenizer = random_1b.model, random_1b.tokenizer
    prompts = [tokenizer("The quick brown fox jumps over")["input_ids"], tokenizer("1, 2, 3,")["input_ids"]]
    continuations = [[791, 4062], [220, 19]]
    runner = PagedLlama(model)
    cache = runner.new_cache(token_budget=128, block_size=16)
    for slot in ("a", "b"):
        cache.blocks.allocate(slot)
    prefill = runner.run(cache, [("a", prompts[0]), ("b", prompts[1])], logits="all")  # [len(prompt), vocab] each
    steps = [runner.run(cache, [("a", [continuations[0][step]]), ("b", [continuations[1][step]])], prompt=False)
             for step in range(2)]  # [vocab] per request
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        with torch.inference_mode():
            reference = model(torch.tensor([prompt + continuation])).logits[0]  # [len, vocab]
        got = torch.cat([prefill[i], *(step[i][None] for step in steps)])  # [len, vocab]
        assert reference.abs().max() > 1, "logits too small for the tolerance to mean anything"
        torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)


def test_the_llama_3_2_tokenizer_with_the_llama_3_chat_format(random_1b: LoadedModel) -> None:
    tokenizer = load_tokenizer("random:llama-3.2-3b")
    assert tokenizer.chat_template is not None
    ids = encode_chat(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}])
    begin, header, end_header, end_turn = 128_000, 128_006, 128_007, 128_009
    assert ids[:2] == [begin, header] and ids.count(begin) == 1 and ids.count(end_turn) == 2
    assert tokenizer.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids[-4:-1] == [header, tokenizer.convert_tokens_to_ids("assistant"), end_header]
    # The pip tokenizer also holds <|image|> of the vision models, one id past the text
    # models' 128,256 embedding rows: a prompt spelling it is refused as outside the vocabulary.
    assert len(tokenizer) == 128_257 and tokenizer.convert_ids_to_tokens(128_256) == "<|image|>"
    info = TokenizerInfo.of(random_1b.model, random_1b.tokenizer)
    assert (info.vocab_size, info.eos_token_ids) == (128_256, (128_001, 128_008, 128_009))
    assert info == TokenizerInfo.of(random_1b.model, tokenizer)  # 1B and 3B: interchangeable tokens

