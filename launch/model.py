"""A small decoder-only transformer in plain JAX whose attention is ringflash.ring_attention.

Parameters are a pytree of arrays (dicts and a list of layers). Activations live on a 2-D
mesh: batch over the "data" axis, sequence over the ring axis "sp"; the parameters are
replicated. The mesh's axes are of the Explicit type, so inside jit every activation carries
its sharding in its type ([B@data, T@sp, ...]) and ring_attention reads the batch sharding off
its inputs: each data-parallel group runs its own ring, and nothing is gathered.

RoPE positions are an input array with the same sharding as the tokens, so the device that
holds token t also holds position t, whatever the layout: with T = 4096 on a ring of 4, the
device at ring index 2 holds tokens and positions 2048..3071 and rotates its queries and keys
by exactly those angles; ring_attention's causal mask uses the same global indices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringflash

DATA_AXIS = "data"
RING_AXIS = "sp"
EMBED_INIT_STD = 0.05
MAX_PARAMS = 2**30


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of the transformer.

  Attributes:
    vocab_size: number of token ids.
    d_model: width of the residual stream.
    num_heads: attention heads; head_dim = d_model // num_heads.
    num_layers: transformer blocks.
    d_ff: hidden width of the MLP.
    rope_base: RoPE wavelength base.
    dropout: residual dropout rate during training (0 disables it).
  """

  vocab_size: int
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  d_ff: int = 256
  rope_base: float = 10000.0
  dropout: float = 0.0

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by "
                       f"num_heads={self.num_heads}")
    if (self.d_model // self.num_heads) % 2:
      raise ValueError(f"d_model={self.d_model} / num_heads={self.num_heads} = "
                       f"{self.d_model // self.num_heads} (head_dim) must be even for RoPE")
    for name in ("rope_base", "dropout"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(
          value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not self.rope_base > 0:      # 0 or less: NaN and inf angles, every logit NaN
      raise ValueError(f"rope_base must be > 0, got {self.rope_base!r}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    if self.num_params > MAX_PARAMS:
      # Replicated on every device with their gradient and AdamW's two moments: a mistyped
      # size (--d_ff=1000000000) asked for hundreds of GiB, and the job waited for an
      # allocation that never came back.
      raise ValueError(f"the model is too large: d_model={self.d_model}, d_ff={self.d_ff}, "
                       f"num_layers={self.num_layers} and the vocabulary of {self.vocab_size} "
                       f"token ids make {self.num_params} parameters; at most 2**30 = "
                       f"{MAX_PARAMS} (each device holds them in float32 with their gradient "
                       f"and AdamW's two moments: 16 GiB at the bound)")

  @property
  def num_params(self) -> int:
    """The parameters init_params makes."""
    d, f = self.d_model, self.d_ff
    return 2 * self.vocab_size * d + d + self.num_layers * (4 * d * d + 2 * d * f + 2 * d)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def make_mesh(data: int, ring: int, devices=None) -> Mesh:
  """A ("data", "sp") mesh of Explicit axes over the first data * ring devices.

  Args:
    data: devices along the batch axis.
    ring: devices along the sequence axis (the ring).
    devices: devices to use, default jax.devices() (all processes' devices).

  Raises:
    ValueError: when fewer than data * ring devices are available.
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or ring < 1 or data * ring > len(devices):
    raise ValueError(f"mesh data={data} x ring={ring} needs {data * ring} devices, "
                     f"{len(devices)} available")
  grid = np.array(devices[:data * ring], dtype=object).reshape(data, ring)
  return Mesh(grid, (DATA_AXIS, RING_AXIS), axis_types=(AxisType.Explicit,) * 2)


def token_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of [B, T] token, position and target arrays: batch on data, sequence on sp."""
  return NamedSharding(mesh, P(DATA_AXIS, RING_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def init_params(config: ModelConfig, key) -> dict:
  """Initial parameters (float32), a pytree of plain arrays.

  Returns:
    {"embed": [V, D], "layers": [per layer {"attn_norm": [D], "wq"/"wk"/"wv": [D, N, Hd],
     "wo": [N, Hd, D], "mlp_norm": [D], "w_in": [D, F], "w_out": [F, D]}],
     "final_norm": [D], "unembed": [D, V]}
  """
  d, n, hd, f, v = config.d_model, config.num_heads, config.head_dim, config.d_ff, config.vocab_size
  keys = jax.random.split(key, 2 + config.num_layers)

  def normal(k, shape, fan_in):
    return jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)

  layers = []
  for i in range(config.num_layers):
    kq, kk, kv, ko, k1, k2 = jax.random.split(keys[2 + i], 6)
    layers.append({
        "attn_norm": jnp.ones((d,), jnp.float32),
        "wq": normal(kq, (d, n, hd), d),
        "wk": normal(kk, (d, n, hd), d),
        "wv": normal(kv, (d, n, hd), d),
        # Output projections start small so each block begins close to the identity.
        "wo": normal(ko, (n, hd, d), n * hd) / math.sqrt(2 * config.num_layers),
        "mlp_norm": jnp.ones((d,), jnp.float32),
        "w_in": normal(k1, (d, f), d),
        "w_out": normal(k2, (f, d), f) / math.sqrt(2 * config.num_layers),
    })
  return {
      # Small embeddings: every use of the residual stream is normalized first, so their
      # scale only sets how fast Adam (steps of about the learning rate) can reshape them.
      # At std 1 the rows of rare tokens barely move in a few hundred steps.
      "embed": EMBED_INIT_STD * jax.random.normal(keys[0], (v, d), jnp.float32),
      "layers": layers,
      "final_norm": jnp.ones((d,), jnp.float32),
      "unembed": normal(keys[1], (d, v), d),
  }


def rms_norm(x, scale, eps: float = 1e-6):
  """x [..., D] scaled to unit root-mean-square, times scale [D]."""
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * scale


def rope(x, positions, base: float):
  """Rotary position embedding.

  Args:
    x: [B, T, N, Hd] queries or keys.
    positions: [B, T] int32 global token indices, sharded like x's first two dimensions.
    base: wavelength base.

  Returns:
    x rotated pairwise: dimension i and i + Hd/2 by the angle positions * base^(-2i/Hd).
  """
  half = x.shape[-1] // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)       # [Hd/2]
  angle = positions.astype(jnp.float32)[:, :, None, None] * inv_freq     # [B, T, 1, Hd/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dropout(x, rate: float, key):
  if rate == 0.0 or key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def forward(params: dict, tokens, positions, config: ModelConfig, mesh: Mesh, *,
            dropout_key=None, backend: str = "auto", return_kv: bool = False):
  """Logits of the next token.

  Call inside jit under `jax.set_mesh(mesh)` (or with concrete arrays placed on `mesh`).

  Args:
    params: from init_params.
    tokens: [B, T] int32, sharded P("data", "sp").
    positions: [B, T] int32 global indices of the tokens, sharded like tokens.
    config: the model's shape.
    mesh: the ("data", "sp") mesh.
    dropout_key: PRNG key for residual dropout; None disables dropout (evaluation).
    backend: ring attention backend.
    return_kv: also return each layer's keys and values (a prefill for decode_step).

  Returns:
    logits [B, T, V] float32, sharded P("data", "sp", None); with return_kv, (logits,
    [(k, v) per layer]), each [B, T, N, Hd] sharded P("data", "sp", None, None).
  """
  # A one-hot matmul rather than a gather: the vocabulary is small, and the product keeps the
  # tokens' sharding without any sharding annotation.
  x = jax.nn.one_hot(tokens, config.vocab_size, dtype=jnp.float32) @ params["embed"]
  layer_keys = (None,) * config.num_layers if dropout_key is None else tuple(
      jax.random.split(dropout_key, 2 * config.num_layers))
  kvs = []
  for i, layer in enumerate(params["layers"]):
    q, k, v = _attention_inputs(layer, x, positions, config)
    kvs.append((k, v))
    a = ringflash.ring_attention(q, k, v, mesh=mesh, axis_name=RING_AXIS, is_causal=True,
                                 backend=backend)
    x = _block_rest(layer, x, a, config,
                    None if dropout_key is None else layer_keys[2 * i:2 * i + 2])
  logits = rms_norm(x, params["final_norm"]) @ params["unembed"]
  return (logits, kvs) if return_kv else logits


def _attention_inputs(layer: dict, x, positions, config: ModelConfig):
  """q, k (RoPE at `positions`) and v [B, T, N, Hd] of one block's attention."""
  h = rms_norm(x, layer["attn_norm"])
  q = rope(jnp.einsum("btd,dnh->btnh", h, layer["wq"]), positions, config.rope_base)
  k = rope(jnp.einsum("btd,dnh->btnh", h, layer["wk"]), positions, config.rope_base)
  v = jnp.einsum("btd,dnh->btnh", h, layer["wv"])
  return q, k, v


def _block_rest(layer: dict, x, a, config: ModelConfig, keys=None):
  """The block after attention: output projection, residual, MLP, residual (dropout with
  keys = (attention's, MLP's) when given)."""
  x = x + _dropout(jnp.einsum("btnh,nhd->btd", a, layer["wo"]), config.dropout,
                   None if keys is None else keys[0])
  h = rms_norm(x, layer["mlp_norm"])
  m = jax.nn.gelu(h @ layer["w_in"]) @ layer["w_out"]
  return x + _dropout(m, config.dropout, None if keys is None else keys[1])


def decode_step(params: dict, tokens, caches: list, config: ModelConfig, *,
                backend: str = "auto"):
  """Logits of the token after each of t new tokens, attending through a KV cache per layer.

  The new tokens take the positions caches[0].lengths .. + t - 1 (RoPE and masks); each
  layer appends their keys and values to its cache (ringflash.KVCache, from a prefill with
  forward(..., return_kv=True)), then attends with ringflash's decode attention: each device
  attends the cache slots it holds, and one reduction combines them. No dropout.

  Args:
    params: from init_params.
    tokens: [B, t] int32 (replicated over "sp", batch as the caches').
    caches: one ringflash.KVCache per layer.
    config: the model's shape.
    backend: decode attention backend.

  Returns:
    (logits [B, t, V] float32, the caches with the new tokens appended).
  """
  t = tokens.shape[1]
  positions = caches[0].lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
  x = jax.nn.one_hot(tokens, config.vocab_size, dtype=jnp.float32) @ params["embed"]
  new_caches = []
  for layer, cache in zip(params["layers"], caches, strict=True):
    q, k, v = _attention_inputs(layer, x, positions, config)
    cache = cache.append(k, v)
    new_caches.append(cache)
    x = _block_rest(layer, x, cache.attention(q, backend=backend), config)
  return rms_norm(x, params["final_norm"]) @ params["unembed"], new_caches


def answer_loss(logits, targets, weights):
  """Mean cross-entropy and accuracy over the weighted (answer) positions.

  Args:
    logits: [B, T, V] float32.
    targets: [B, T] int32 next-token ids.
    weights: [B, T] float32, 1 at answer positions, 0 elsewhere.

  Returns:
    (loss, accuracy) float32 scalars.
  """
  logp = jax.nn.log_softmax(logits, axis=-1)
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype)
  nll = -jnp.sum(logp * onehot, axis=-1)                                # [B, T]
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  total = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum(nll * weights) / total, jnp.sum(correct * weights) / total
