"""T5 v1.1 encoder (models.t5, loaded by models.t5_weights): parity with transformers'
T5EncoderModel, loading, sharding, tokenizer."""

import json
import shutil

from flax import nnx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
import torch

from g2rpo_jax import parallel
from g2rpo_jax.models import t5, t5_weights, weights


def _transformers():
    """transformers, importable even next to a torchvision built for another torch.

    transformers imports torchvision (for image utilities T5 never uses) whenever it is installed,
    and a mismatched build fails on import ("operator torchvision::nms does not exist"). Then
    transformers is told torchvision is absent, which only affects vision models.
    """
    try:
        import torchvision  # noqa: F401
    except Exception:  # a broken build raises RuntimeError, not ImportError
        import transformers.utils as transformers_utils
        import transformers.utils.import_utils as import_utils

        import_utils.is_torchvision_available = lambda: False
        transformers_utils.is_torchvision_available = lambda: False
    import transformers

    return transformers


# Two tiny shapes: v1.1's gated-gelu (inner_dim 32 = d_model), and the original T5's relu with
# few buckets and a short max_distance, so a 40-token input reaches the clipped buckets.
TINY = dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
VARIANTS = {
    "gated-gelu": dict(TINY, feed_forward_proj="gated-gelu"),
    "relu": dict(TINY, d_kv=6, feed_forward_proj="relu", relative_attention_num_buckets=8,
                 relative_attention_max_distance=16),
}
LENGTHS = {"gated-gelu": 12, "relu": 40}


def _write_reference(directory, seed: int, **config):
    """A random transformers T5EncoderModel saved to `directory`; returns the torch model."""
    transformers = _transformers()
    torch.manual_seed(seed)
    model = transformers.T5EncoderModel(transformers.T5Config(**config)).eval()
    with torch.no_grad():  # norms start at 1: make them random so their mapping is checked
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """variant → (folder, torch model)."""
    out = {}
    for seed, (name, config) in enumerate(VARIANTS.items()):
        directory = tmp_path_factory.mktemp(name)
        out[name] = (directory, _write_reference(directory, seed, **config))
    return out


def _inputs(batch: int, length: int, vocab: int, seed: int = 0):
    """Random ids [B, T] with right padding (id 0) of different lengths, and the mask [B, T]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    valid = np.linspace(length, 3, batch).astype(int)  # the first row has no padding
    mask = (np.arange(length)[None] < valid[:, None]).astype(np.int32)
    return ids * mask, mask


def _torch_forward(model, ids, mask=None):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(),
                    attention_mask=None if mask is None else torch.from_numpy(mask).long())
    return out.last_hidden_state.numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_transformers(references, variant):
    directory, torch_model = references[variant]
    ids, mask = _inputs(3, LENGTHS[variant], TINY["vocab_size"])
    assert mask.min() == 0  # padding is exercised
    expected = _torch_forward(torch_model, ids, mask)
    model = t5_weights.from_pretrained(directory)
    assert model.cfg.feed_forward_proj == variant
    got = np.asarray(model(ids, mask))
    err = np.abs(got - expected).max()
    print(f"T5 parity {variant}: max abs err {err:.2e} (|out| max {np.abs(expected).max():.2f})")
    assert got.shape == expected.shape
    assert err <= 1e-4
    # No mask (how FLUX.1-dev's pipeline calls it): pad tokens are attended to.
    err_no_mask = np.abs(np.asarray(model(ids)) - _torch_forward(torch_model, ids)).max()
    print(f"T5 parity {variant} without mask: max abs err {err_no_mask:.2e}")
    assert err_no_mask <= 1e-4
    # Unrolled layers compute the same thing as the scan.
    unrolled = np.asarray(t5_weights.from_pretrained(directory, scan_layers=False)(ids, mask))
    np.testing.assert_allclose(unrolled, got, atol=1e-5)


def test_bfloat16_compute_stays_close(references):
    directory, torch_model = references["gated-gelu"]
    ids, mask = _inputs(2, 12, TINY["vocab_size"])
    expected = _torch_forward(torch_model, ids, mask)
    got = np.asarray(t5_weights.from_pretrained(directory, dtype="bfloat16")(ids, mask), np.float32)
    rel = np.abs(got - expected).max() / np.abs(expected).max()
    print(f"T5 bfloat16 compute: max abs err / max |out| = {rel:.2e}")
    assert rel < 5e-2


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 16), (16, 40)])
def test_buckets_match_transformers(num_buckets, max_distance):
    transformers = _transformers()
    attention = transformers.models.t5.modeling_t5.T5Attention
    length = 600
    relative = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    expected = attention._relative_position_bucket(relative, bidirectional=True,
                                                   num_buckets=num_buckets,
                                                   max_distance=max_distance).numpy()
    got = t5.relative_position_buckets(length, length, num_buckets, max_distance)
    np.testing.assert_array_equal(got, expected)


def test_sharded_index_and_parent_folder(references, tmp_path):
    """A sharded checkpoint (index + several files) inside `text_encoder_2/` loads the same."""
    directory, torch_model = references["gated-gelu"]
    sharded = tmp_path / "text_encoder_2"
    torch_model.save_pretrained(sharded, safe_serialization=True, max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids, mask = _inputs(3, 12, TINY["vocab_size"])
    np.testing.assert_array_equal(np.asarray(t5_weights.from_pretrained(tmp_path)(ids, mask)),
                                  np.asarray(t5_weights.from_pretrained(directory)(ids, mask)))


@pytest.mark.parametrize("names", [("encoder.embed_tokens.weight",),
                                   ("shared.weight", "encoder.embed_tokens.weight")])
def test_either_embedding_key_loads(references, tmp_path, names):
    directory, _ = references["gated-gelu"]
    tensors = load_file(str(directory / "model.safetensors"))
    embedding = tensors.pop("shared.weight")
    save_file({**tensors, **{name: embedding for name in names}},
              str(tmp_path / "model.safetensors"))
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    ids, mask = _inputs(2, 12, TINY["vocab_size"])
    np.testing.assert_array_equal(np.asarray(t5_weights.from_pretrained(tmp_path)(ids, mask)),
                                  np.asarray(t5_weights.from_pretrained(directory)(ids, mask)))


def _broken_copy(directory, target, edit):
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    shutil.copy(directory / "config.json", target / "config.json")
    return target


def test_missing_tensor_is_named(references, tmp_path):
    directory, _ = references["gated-gelu"]
    key = "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"
    broken = _broken_copy(directory, tmp_path, lambda t: t.pop(key))
    with pytest.raises(weights.CheckpointMismatchError) as error:
        t5_weights.from_pretrained(broken)
    message = str(error.value)
    print(message)
    assert key in message and "layers.ff.wi_1.kernel" in message and "(32, 64)" in message


def test_wrong_shape_is_named(references, tmp_path):
    directory, _ = references["gated-gelu"]
    key = "encoder.block.0.layer.0.SelfAttention.q.weight"

    def edit(tensors):
        tensors[key] = tensors[key][:24]

    broken = _broken_copy(directory, tmp_path, edit)
    with pytest.raises(weights.CheckpointMismatchError) as error:
        t5_weights.from_pretrained(broken)
    message = str(error.value)
    print(message)
    assert key in message and "(24, 32)" in message and "(32, 32)" in message


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        t5_weights.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="bert"):
        t5_weights.from_pretrained(tmp_path)


def test_sharded_forward_matches_unsharded(references):
    directory, _ = references["gated-gelu"]
    ids, mask = _inputs(4, 12, TINY["vocab_size"], seed=1)
    expected = np.asarray(t5_weights.from_pretrained(directory)(ids, mask))

    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = t5_weights.from_pretrained(directory, mesh=mesh)
    kernel = model.layers.attn.q.kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert kernel.addressable_shards[0].data.size == kernel.size // 4
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    ids_s, mask_s = (jax.device_put(a, parallel.batch_sharding(mesh, a.shape)) for a in (ids, mask))
    with jax.set_mesh(mesh):
        got = forward(state, ids_s, mask_s)
    assert got.sharding.spec[0] is not None  # the batch stays split
    err = np.abs(np.asarray(got) - expected).max()
    print(f"T5 mesh (data 2, fsdp 2, tensor 2): max abs err vs unsharded {err:.2e}")
    assert err <= 1e-5


def test_mesh_must_split_whole_heads(references):
    directory, _ = references["relu"]
    mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 8})
    with pytest.raises(ValueError, match="num_heads=4"):
        t5_weights.from_pretrained(directory, mesh=mesh)


def test_xxl_parameter_count():
    cfg = t5.T5Config()  # T5-v1.1-XXL encoder
    d, inner, ff, layers = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff, cfg.num_layers
    per_layer = 4 * d * inner + 3 * d * ff + 2 * d  # q k v o, wi_0 wi_1 wo, two norms
    by_hand = (cfg.vocab_size * d + layers * per_layer
               + cfg.relative_attention_num_buckets * cfg.num_heads + d)
    counted = t5.count_params(cfg)
    print(f"T5-v1.1-XXL encoder parameters: {counted:,} (by hand {by_hand:,})")
    assert counted == by_hand == 4_762_310_656


def test_config_from_transformers_json(references):
    directory, _ = references["relu"]
    values = json.loads((directory / "config.json").read_text())
    cfg = t5.T5Config.from_dict(values)  # unknown keys (num_decoder_layers, ...) are ignored
    assert (cfg.d_kv, cfg.relative_attention_num_buckets, cfg.is_gated) == (6, 8, False)
    # The file's "dtype" is its storage dtype, not our compute dtype.
    assert t5_weights.load_config(directory).dtype == "float32"
    with pytest.raises(ValueError, match="gated-<activation>"):
        t5.T5Config(feed_forward_proj="fancy-gated-gelu")


def test_tokenizer_pads_and_truncates(tmp_path):
    transformers = _transformers()
    words = ["a", "red", "cat", "on", "the", "mat", "blue", "dog"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(f"▁{w}", -3.0 - i * 0.1) for i, w in enumerate(words)]
    tokenizer = transformers.T5TokenizerFast(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(tmp_path / "tokenizer_2")

    loaded = t5.load_tokenizer(tmp_path)  # the parent folder, as in a FLUX repo
    ids, mask = t5.tokenize(loaded, ["a red cat", "a blue dog on the mat a red cat on the mat"],
                            max_length=8)
    assert ids.shape == mask.shape == (2, 8) and ids.dtype == np.int32
    eos, pad = loaded.eos_token_id, loaded.pad_token_id
    assert (eos, pad) == (1, 0)
    np.testing.assert_array_equal(ids[0], [4, 5, 6, eos, pad, pad, pad, pad])
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 1, 0, 0, 0, 0])
    assert mask[1].all() and ids[1, -1] == eos  # truncated, still ends with </s>
    with pytest.raises(TypeError):
        t5.tokenize(loaded, "a red cat")
    with pytest.raises(FileNotFoundError, match="tokenizer_2"):
        t5.load_tokenizer(tmp_path / "nowhere")


def test_counts_match_the_torch_model(references):
    for name, (_, torch_model) in references.items():
        torch_count = sum(p.numel() for p in torch_model.parameters())
        assert t5.count_params(t5.T5Config(**VARIANTS[name])) == torch_count, name
