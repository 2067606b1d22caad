"""``DeepSpeedTransformerLayer``: one BERT encoder layer, Pre-LN or Post-LN, with DeepSpeed's
constructor, config fields and parameter names, written with PyTorch ops (no native kernel).

The layer computes what DeepSpeed's CUDA kernel computes, with its parameters:

* Pre-LN (``pre_layer_norm=True``)::

    h = x + dropout(attention(LN(x; norm_w, norm_b)) @ attn_ow.T + attn_ob)
    y = h + dropout(gelu(LN(h; attn_nw, attn_nb) @ inter_w.T + inter_b) @ output_w.T + output_b)

* Post-LN (BERT's original order)::

    a = LN(x + dropout(attention(x) @ attn_ow.T + attn_ob); attn_nw, attn_nb)
    y = LN(a + dropout(gelu(a @ inter_w.T + inter_b) @ output_w.T + output_b); norm_w, norm_b)

``attention`` projects with the fused ``attn_qkvw`` (3*hidden, hidden) and ``attn_qkvb``, scales
scores by 1/sqrt(head size), adds ``attention_mask`` (additive, broadcast to (batch, heads,
query, key), BERT's extended mask of 0 / -10000) before the softmax, and drops probabilities
with ``attn_dropout_ratio``; the hidden dropouts use ``hidden_dropout_ratio``. GeLU is the tanh
approximation, as in DeepSpeed's kernel. ``gelu_checkpoint`` and ``attn_dropout_checkpoint``
recompute the GeLU output and the attention probabilities in backward instead of keeping them;
``normalize_invertible`` and ``stochastic_mode`` (memory and speed options of the native kernel)
change nothing here. Dropout draws from torch's random generator (``seed`` is not used).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardspeed.accelerator import get_accelerator
from shardspeed.utils.logging import logger

__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer", "TransformerConfig"]


class TransformerConfig:
    """The sizes every transformer layer config has (DeepSpeed's base class)."""

    def __init__(
        self,
        batch_size: int,
        hidden_size: int,
        intermediate_size: int,
        heads: int,
        attn_dropout_ratio: float,
        hidden_dropout_ratio: float,
        num_hidden_layers: int,
        initializer_range: float,
    ) -> None:
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range


class DeepSpeedTransformerConfig(TransformerConfig):
    """DeepSpeed's transformer layer configuration, same arguments and defaults.

    ``batch_size`` is the largest batch (unused here: nothing is preallocated);
    ``intermediate_size`` <= 0 means 4 * ``hidden_size``; negative dropout ratios mean no
    dropout; ``adjust_init_range`` scales the initial std of the two output projections by
    1/sqrt(2 * ``num_hidden_layers``); ``return_tuple`` makes ``forward`` return ``(output,)``;
    ``training`` is overwritten by the module's mode at each forward."""

    def __init__(
        self,
        batch_size: int = -1,
        hidden_size: int = -1,
        intermediate_size: int = -1,
        heads: int = -1,
        attn_dropout_ratio: float = -1,
        hidden_dropout_ratio: float = -1,
        num_hidden_layers: int = -1,
        initializer_range: float = -1,
        layer_norm_eps: float = 1e-12,
        local_rank: int = -1,
        seed: int = -1,
        fp16: bool = False,
        pre_layer_norm: bool = True,
        normalize_invertible: bool = False,
        gelu_checkpoint: bool = False,
        adjust_init_range: bool = True,
        attn_dropout_checkpoint: bool = False,
        stochastic_mode: bool = False,
        return_tuple: bool = False,
        training: bool = True,
    ) -> None:
        super().__init__(
            batch_size,
            hidden_size,
            intermediate_size if intermediate_size > 0 else 4 * hidden_size,
            heads,
            attn_dropout_ratio,
            hidden_dropout_ratio,
            num_hidden_layers,
            initializer_range,
        )
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> DeepSpeedTransformerConfig:
        """A default config with the dict's keys set as attributes (as DeepSpeed does)."""
        config = cls()
        for key, value in json_object.items():
            config.__dict__[key] = value
        return config

    @classmethod
    def from_json_file(cls, json_file: str | Path) -> DeepSpeedTransformerConfig:
        """Read a JSON file: UTF-16 (DeepSpeed's encoding, with its byte-order mark) or UTF-8."""
        raw = Path(json_file).read_bytes()
        utf16 = raw.startswith((b"\xff\xfe", b"\xfe\xff"))
        return cls.from_dict(json.loads(raw.decode("utf-16" if utf16 else "utf-8")))


class DeepSpeedTransformerLayer(nn.Module):
    """One transformer encoder layer with DeepSpeed's parameters (``attn_qkvw``, ``attn_qkvb``,
    ``attn_ow``, ``attn_ob``, ``attn_nw``, ``attn_nb``, ``inter_w``, ``inter_b``, ``output_w``,
    ``output_b``, ``norm_w``, ``norm_b``); see the module docstring for the computation.

    ``layer_id`` (class attribute) counts the layers built; each layer's config gets its index.
    ``initial_weights`` / ``initial_biases`` (8 each: query, key, value, attention output,
    attention norm, intermediate, output, norm) give the starting values, as in DeepSpeed's
    unit tests: query/key/value are concatenated into ``attn_qkvw`` (and their biases into
    ``attn_qkvb``), the others are used as they are."""

    layer_id = 0

    def __init__(
        self,
        config: DeepSpeedTransformerConfig,
        initial_weights: list[torch.Tensor] | None = None,
        initial_biases: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        _check(config)
        self.config = config
        self.config.layer_id = DeepSpeedTransformerLayer.layer_id
        DeepSpeedTransformerLayer.layer_id += 1
        logger.info(f"DeepSpeed Transformer config is {self.config.__dict__}")
        if config.local_rank >= 0:
            get_accelerator().set_device(config.local_rank)
        hidden, inner = config.hidden_size, config.intermediate_size
        if initial_weights is None and initial_biases is None:
            self.attn_qkvw = nn.Parameter(torch.empty(3 * hidden, hidden))
            self.attn_qkvb = nn.Parameter(torch.empty(3 * hidden))
            self.attn_ow = nn.Parameter(torch.empty(hidden, hidden))
            self.attn_ob = nn.Parameter(torch.empty(hidden))
            self.attn_nw = nn.Parameter(torch.empty(hidden))
            self.attn_nb = nn.Parameter(torch.empty(hidden))
            self.inter_w = nn.Parameter(torch.empty(inner, hidden))
            self.inter_b = nn.Parameter(torch.empty(inner))
            self.output_w = nn.Parameter(torch.empty(hidden, inner))
            self.output_b = nn.Parameter(torch.empty(hidden))
            self.norm_w = nn.Parameter(torch.empty(hidden))
            self.norm_b = nn.Parameter(torch.empty(hidden))
            self.init_transformer_weights(config.adjust_init_range)
        else:
            self._take_initial(initial_weights, initial_biases)

    def _take_initial(
        self, weights: list[torch.Tensor] | None, biases: list[torch.Tensor] | None
    ) -> None:
        if weights is None or biases is None or len(weights) != 8 or len(biases) != 8:
            raise ValueError(
                "initial_weights and initial_biases must both be given, 8 tensors each (query, "
                "key, value, attention output, attention norm, intermediate, output, norm)"
            )
        self.attn_qkvw = nn.Parameter(torch.cat([w.detach() for w in weights[:3]]))
        self.attn_qkvb = nn.Parameter(torch.cat([b.detach() for b in biases[:3]]))
        names = ("attn_o", "attn_n", "inter_", "output_", "norm_")
        for name, weight, bias in zip(names, weights[3:], biases[3:], strict=True):
            setattr(self, f"{name}w", _parameter(weight))
            setattr(self, f"{name}b", _parameter(bias))

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """Normal(0, ``initializer_range``) weights (the two output projections scaled down by
        1/sqrt(2 * layers) with ``adjust_init_range``), zero biases, unit norm gains."""
        std, layers = self.config.initializer_range, self.config.num_hidden_layers
        if std < 0:
            raise ValueError(
                f"initializer_range={std}: set DeepSpeedTransformerConfig.initializer_range "
                "(e.g. 0.02) to initialise the weights, or pass initial_weights."
            )
        # DeepSpeed scales only where local_rank == 0, so ranks would start differently; here
        # every rank does, whenever there is a layer count to scale by
        output_std = std / math.sqrt(2.0 * layers) if adjust_init_range and layers > 0 else std
        with torch.no_grad():
            for weight in (self.attn_qkvw, self.inter_w):
                weight.normal_(mean=0.0, std=std)
            for weight in (self.attn_ow, self.output_w):
                weight.normal_(mean=0.0, std=output_std)
            for gain in (self.attn_nw, self.norm_w):
                gain.fill_(1.0)
            for bias in (self.attn_qkvb, self.attn_ob, self.attn_nb, self.inter_b):
                bias.zero_()
            for bias in (self.output_b, self.norm_b):
                bias.zero_()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_mask: torch.Tensor | None = None,
        layer_head_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_value: Any = None,
        output_attentions: bool = False,
        grads: list[Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor]:
        """The layer's output for ``hidden_states`` (batch, sequence, hidden); ``attention_mask``
        is added to the attention scores. Hugging Face's other layer arguments are accepted
        for its call signature but must be left unset (this is a self-attention encoder
        layer). ``grads``, a list, collects ``[gradient, name]`` pairs in backward (DeepSpeed's
        test hook)."""
        unsupported = {
            "head_mask": head_mask,
            "layer_head_mask": layer_head_mask,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_attention_mask": encoder_attention_mask,
            "past_key_value": past_key_value,
        }
        given = [name for name, value in unsupported.items() if value is not None]
        if given or output_attentions:
            raise ValueError(
                f"DeepSpeedTransformerLayer is a self-attention encoder layer; "
                f"{', '.join(given or ['output_attentions=True'])} is not supported: leave it unset"
            )
        self.config.is_grad_enabled = torch.is_grad_enabled()
        self.config.training = self.training
        if grads is not None:
            self._record_grads(grads)
        output = self._layer(hidden_states, attention_mask)
        return (output,) if self.config.return_tuple else output

    def _layer(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        config = self.config
        if config.pre_layer_norm:
            h = x + self._attention_out(self._norm(x, self.norm_w, self.norm_b), mask)
            return h + self._mlp_out(self._norm(h, self.attn_nw, self.attn_nb))
        a = self._norm(x + self._attention_out(x, mask), self.attn_nw, self.attn_nb)
        return self._norm(a + self._mlp_out(a), self.norm_w, self.norm_b)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.config.hidden_size,), weight, bias, self.config.layer_norm_eps)

    def _attention_out(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Dropout of the attention block's output projection (bias included)."""
        batch, seq, hidden = x.shape
        heads = self.config.heads
        qkv = F.linear(x, self.attn_qkvw, self.attn_qkvb)
        q, k, v = (
            t.view(batch, seq, heads, hidden // heads).transpose(1, 2)
            for t in qkv.split(hidden, dim=-1)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // heads)
        if mask is not None:
            scores = scores + mask.to(scores.dtype)  # an fp32 mask must not promote fp16 scores
        if self.config.attn_dropout_checkpoint and self._keeps_graph():
            probs = checkpoint(self._probabilities, scores, use_reentrant=False)
        else:
            probs = self._probabilities(scores)
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, hidden)
        return self._dropout(F.linear(context, self.attn_ow, self.attn_ob), _hidden_p(self.config))

    def _probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        return self._dropout(scores.softmax(dim=-1), _ratio(self.config.attn_dropout_ratio))

    def _mlp_out(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout of the feed-forward block's output (bias included)."""
        inner = F.linear(x, self.inter_w, self.inter_b)
        if self.config.gelu_checkpoint and self._keeps_graph():
            activated = checkpoint(_gelu, inner, use_reentrant=False)
        else:
            activated = _gelu(inner)
        return self._dropout(
            F.linear(activated, self.output_w, self.output_b), _hidden_p(self.config)
        )

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        return F.dropout(x, p, training=self.training) if p > 0 else x

    def _keeps_graph(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _record_grads(self, grads: list[Any]) -> None:
        hidden = self.config.hidden_size
        value = slice(2 * hidden, 3 * hidden)
        self.attn_qkvw.register_hook(lambda g: grads.append([g[value], "V_W"]))
        self.attn_qkvb.register_hook(lambda g: grads.append([g[value], "V_B"]))
        named = {
            "attn_ow": "O_W",
            "attn_ob": "O_B",
            "attn_nw": "N2_W",
            "attn_nb": "N2_B",
            "inter_w": "int_W",
            "inter_b": "int_B",
            "output_w": "out_W",
            "output_b": "out_B",
            "norm_w": "norm_W",
            "norm_b": "norm_B",
        }
        for attribute, label in named.items():
            getattr(self, attribute).register_hook(lambda g, label=label: grads.append([g, label]))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _ratio(p: float) -> float:
    return max(float(p), 0.0)


def _hidden_p(config: DeepSpeedTransformerConfig) -> float:
    return _ratio(config.hidden_dropout_ratio)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor.detach())


def _check(config: DeepSpeedTransformerConfig) -> None:
    if config.hidden_size <= 0 or config.heads <= 0:
        raise ValueError(
            f"DeepSpeedTransformerConfig needs hidden_size and heads > 0 (got hidden_size="
            f"{config.hidden_size}, heads={config.heads}); set both."
        )
    if config.hidden_size % config.heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not divisible by heads={config.heads}; "
            "choose a head count that divides the hidden size."
        )
    for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
        if getattr(config, name) >= 1:
            raise ValueError(f"{name}={getattr(config, name)} must be below 1.")
