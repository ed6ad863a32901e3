"""On the real offline model (SmolLM2-135M-Instruct, dequantized GGUF): exact equality on a handful of prompts."""
import pytest

from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft, PromptLookupDraft, early_exit_model
from specnb.kernels import kernels_of, make, onednn_available, use_kernels
from specnb.prompts import PROMPTS, encode

pytestmark = pytest.mark.real
KINDS = ["code", "prose", "dialogue", "list", "grounded"]
# Every real-model equivalence test and negative control runs under each kernel backend
# (specnb.kernels): MKL, oneDNN, MKL below 4 rows with oneDNN from 4, and specnb's skinny kernels.
BACKENDS = {"mkl": lambda: make("mkl"), "onednn": lambda: make("onednn"), "mixed": lambda: make("mixed", 4),
            "skinny": lambda: make("skinny")}


@pytest.fixture(params=list(BACKENDS))
def real_on(request, real):
    """The real model on one backend; the kernels it was loaded with are restored afterwards."""
    if request.param != "mkl" and not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    before = kernels_of(real.model)
    use_kernels(real.model, BACKENDS[request.param]())
    yield real
    use_kernels(real.model, before)


def one_of_each():
    return [next(p for p in PROMPTS if p.kind == kind) for kind in KINDS]


def test_offline_model_is_what_the_book_says(real):
    cfg = real.model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert "GGUF dequantized" in real.label
    # plain float tensors: the GGUF quantization_config is dropped at load (transformers would otherwise attach its
    # GGUF quantizer and warn that "the weights stay quantized"); it is not part of the draft head's fingerprint
    assert getattr(cfg, "quantization_config", None) is None and getattr(real.model, "hf_quantizer", None) is None
    assert "quantization_config" not in cfg.to_dict()


def test_dequantized_config_drops_only_the_quantization_config():
    from transformers import LlamaConfig

    from specnb.models import _dequantized_config

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    cfg.quantization_config = {"quant_method": "gguf", "dequantize": False}
    before = {k: v for k, v in cfg.to_dict().items() if k != "quantization_config"}
    out = _dequantized_config(cfg)
    assert out is cfg and getattr(cfg, "quantization_config", None) is None
    assert cfg.to_dict() == before
    assert _dequantized_config(cfg) is cfg  # no entry: nothing to drop


def test_speculative_equals_greedy_on_real_prompts(real_on):
    real = real_on
    tok = real.tokenizer
    exit24 = ModelDraft(early_exit_model(real.model, 24), "early exit 24")
    accepted = 0
    for prompt in one_of_each():
        ids = encode(tok, prompt)
        base = greedy(real.model, ids, 20, tok.eos_token_id)
        for draft, k in ((PromptLookupDraft(), 4), (exit24, 3)):
            spec = speculative_greedy(real.model, draft, ids, k, 20, tok.eos_token_id)
            assert spec.tokens == base.tokens, (prompt.kind, draft.name, k)
            accepted += spec.accepted
    assert accepted > 0


def test_negative_control_on_real_model(real_on):
    real = real_on
    tok = real.tokenizer
    prompt = next(p for p in PROMPTS if p.kind == "grounded")
    ids = encode(tok, prompt)
    base = greedy(real.model, ids, 24, tok.eos_token_id)
    broken = speculative_greedy(real.model, PromptLookupDraft(), ids, 4, 24, tok.eos_token_id,
                                rollback_mode="skip-target")
    assert broken.tokens != base.tokens
