"""RNNT transcript head (``stt_model.rnnt_decoder``, ``stt_model.rnnt_joint``) and greedy decoding.

:meth:`RnntTranscriber.step` runs the ``max_symbols`` iterations of greedy decoding on the device
with masked updates, so a frame costs no host read. The session reads the frame's ids once and feeds
them to :class:`TranscriptText`.
Design: docs/api.md, "What each network computes" (the RNNT).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from .config import RnntDecoderConfig, RnntJointConfig
from .layers import Linear, RecurrentCache, RowTensor, adopt, layer_step, linear

__all__ = ["RnntDecoder", "FusedRnntDecoder", "RnntJoint", "RnntState", "RnntTranscriber", "TranscriptText",
           "is_special_piece", "decode_pieces"]

_LANGUAGE_TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2,4}>$")
_SPECIAL_PIECES = frozenset({"<unk>", "<pad>", "<s>", "</s>"})


class RnntDecoder(nn.Module):
    """Prediction network: ``prediction.embed`` [vocab + 1, H] and ``prediction.dec_rnn.lstm``.

    The LSTM state travels packed as ``hc`` [2 * layers, 1, H]: h of every layer, then c, in the
    activation dtype. ``nn.LSTM`` holds the weights under their checkpoint names; steps run
    ``torch.lstm_cell`` per layer (a fused kernel on cuda), which on CPU also avoids the oneDNN RNN
    path, slow for one-token steps.

    Layer 0's input projection is formed as the reference forms it: its two biases summed once in
    their stored dtype, then ``addmm(bias, embed[token], W_ih^T)`` in the promoted dtype of the
    embedding row and the weight (bf16 arithmetic, one rounding, in a bf16 checkpoint); the start
    input (a float32 zero vector) gives the bias alone. Everything after that runs in the activation
    dtype. Each step takes those *input gates* (:meth:`input_gates`) and feeds them to the cell as
    its input bias. :class:`FusedRnntDecoder`, swapped in by ``prepare()``, precomputes them for every
    token (and the start), so a step is one gather, and stores the LSTM weights in the activation
    dtype: the table replaces the embedding and layer 0's input weight (7 MB more than the bf16
    weights at full size).
    """

    def __init__(self, config: RnntDecoderConfig):
        super().__init__()
        config.validate()
        self.hidden = config.pred_hidden
        self.layers = config.pred_rnn_layers
        self.start = config.vocab_size + 1  # the row of the start input in the input-gate table
        self.prediction = nn.ModuleDict({
            "embed": nn.Embedding(config.vocab_size + 1, config.pred_hidden),  # + blank (blank_as_pad)
            "dec_rnn": nn.ModuleDict({"lstm": nn.LSTM(config.pred_hidden, config.pred_hidden,
                                                      config.pred_rnn_layers, batch_first=True)}),
        })
        self.activation_dtype = torch.float32
        self.init_constants()

    def init_constants(self, device: torch.device | str | None = None) -> None:
        """Layer 0's cell takes its input through the bias: a zero input of width 1 and a zero weight."""
        dtype = self.activation_dtype
        self.register_buffer("zero_input", torch.zeros(1, 1, dtype=dtype, device=device), persistent=False)
        self.register_buffer("zero_weight", torch.zeros(4 * self.hidden, 1, dtype=dtype, device=device),
                             persistent=False)

    def _cell(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(W_ih, W_hh, b_ih + b_hh)`` of ``layer`` in the activation dtype (the biases summed in their own)."""
        lstm, dtype = self.prediction["dec_rnn"]["lstm"], self.activation_dtype
        w_ih, w_hh, b_ih, b_hh = (getattr(lstm, f"{name}_l{layer}")
                                  for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        return w_ih.to(dtype), w_hh.to(dtype), (b_ih + b_hh).to(dtype)

    def input_gates(self, tokens: torch.Tensor) -> torch.Tensor:
        """Layer 0's ``x W_ih^T + b`` for ``tokens [N]`` (``self.start``: the zero start input) -> ``[N, 4H]``."""
        lstm, dtype = self.prediction["dec_rnn"]["lstm"], self.activation_dtype
        bias = lstm.bias_ih_l0 + lstm.bias_hh_l0
        embedded = self.prediction["embed"](tokens.clamp(max=self.start - 1))
        gates = linear(embedded, lstm.weight_ih_l0, bias).to(dtype)
        return torch.where((tokens == self.start)[:, None], bias.to(dtype), gates)

    def zero_state(self) -> torch.Tensor:
        return torch.zeros(2 * self.layers, 1, self.hidden, dtype=self.activation_dtype, device=self.zero_input.device)

    def step(self, gates: torch.Tensor, hc: torch.Tensor, with_output: bool = False) -> torch.Tensor:
        """One LSTM step: layer 0's input gates [1, 4H], state hc [2 * layers, 1, H] -> the new hc (its
        h[-1] is the output; ``with_output`` appends it once more as a last row, in the same op)."""
        hs, cs = [], []
        x = self.zero_input.expand(gates.shape[0], -1)
        for layer in range(self.layers):
            w_ih, w_hh, bias = self._cell(layer)
            if layer == 0:  # the input arrives as the bias: (0 + gates) + h W_hh^T, the reference's sum
                w_ih, bias = self.zero_weight, gates
            x, c = torch.lstm_cell(x, (hc[layer], hc[self.layers + layer]), w_ih, w_hh, bias, None)
            hs.append(x)
            cs.append(c)
        return torch.stack(hs + cs + hs[-1:] if with_output else hs + cs)

    def forward(self, tokens: torch.Tensor | None, hc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, U] (None: the start symbol, a zero input) -> (outputs [1, U, H], final hc)."""
        hc = self.zero_state() if hc is None else hc
        if tokens is None:
            tokens = torch.tensor([[self.start]], device=self.zero_input.device)
        gates = self.input_gates(tokens.reshape(-1))
        outputs = []
        for u in range(gates.shape[0]):
            hc = self.step(gates[u:u + 1], hc)
            outputs.append(hc[self.layers - 1])
        return torch.stack(outputs, dim=1), hc


class FusedRnntDecoder(RnntDecoder):
    """``prepare()``'s swap for :class:`RnntDecoder`: layer 0's input gates precomputed for every token
    and the start (``gate_table [vocab + 2, 4H]``, so a step's input is one gather), and each cell's
    weights stored in the activation dtype (buffers ``cell{k}_{w_ih,w_hh,bias}``). The table replaces
    the embedding and layer 0's input weight."""

    def __init__(self, decoder: RnntDecoder):
        adopt(self, decoder)
        tokens = torch.arange(self.start + 1, device=self.zero_input.device)
        self.register_buffer("gate_table", decoder.input_gates(tokens).detach(), persistent=False)
        for layer in range(self.layers):
            for name, t in zip(("w_ih", "w_hh", "bias"), decoder._cell(layer)):
                if layer == 0 and name == "w_ih":  # the gate table replaces it
                    t = self.zero_weight
                self.register_buffer(f"cell{layer}_{name}", t.detach(), persistent=False)
        del self.prediction

    def _cell(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"cell{layer}_w_ih"), getattr(self, f"cell{layer}_w_hh"), getattr(self, f"cell{layer}_bias")

    def input_gates(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gate_table[tokens]


class RnntJoint(nn.Module):
    """``joint_net(enc(e) + pred(p))`` with ``joint_net`` = (ReLU, Identity, Linear) as NeMo names it."""

    def __init__(self, config: RnntJointConfig):
        super().__init__()
        config.validate()
        self.enc = Linear(config.encoder_hidden, config.joint_hidden)
        self.pred = Linear(config.pred_hidden, config.joint_hidden)
        self.joint_net = nn.Sequential(nn.ReLU(), nn.Identity(), Linear(config.joint_hidden, config.num_classes + 1))

    def forward(self, encoded: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        """encoded [B, T, D_enc], prediction [B, U, D_pred] -> logits [B, T, U, classes]."""
        return self.joint_net(self.enc(encoded)[:, :, None] + self.pred(prediction)[:, None])


@dataclass
class RnntState(RecurrentCache):
    """Greedy decoding state: ``hc`` [2 * layers + 1, 1, H] = LSTM h per layer, c per layer, and the
    prediction-network output for the last emitted token (what the joint consumes next); the LSTM
    state is the one after that token (or, at the start, after the zero start input)."""

    hc: torch.Tensor  # [2 * layers + 1, 1, H]: LSTM h and c per layer, then the prediction output

    def batched(self) -> list[RowTensor]:
        return [(self.hc, 1, 1)]  # rows on axis 1, as the LSTM keeps them

    def rebind(self, tensors: list[torch.Tensor]) -> None:
        (self.hc,) = tensors


class RnntTranscriber(nn.Module):
    """Greedy RNNT decoding over encoder frames, offline and one frame at a time."""

    def __init__(self, decoder: RnntDecoder, joint: RnntJoint, blank_id: int, max_symbols: int):
        super().__init__()
        n_classes = joint.joint_net[2].out_features
        if blank_id != n_classes - 1:
            raise ValueError(f"RnntTranscriber: blank_id {blank_id} must be the joint's last class ({n_classes - 1})")
        self.decoder = decoder
        self.joint = joint
        self.blank_id = blank_id
        self.max_symbols = max_symbols

    def new_state(self) -> RnntState:
        # The start symbol (a zero input) run from the zero state: its prediction feeds the first joint,
        # and its LSTM state is the one the first emitted token continues from (as NeMo's greedy
        # decoding keeps the proposed state of a non-blank step); blanks leave both as they are.
        out, hc = self.decoder(None)
        return RnntState(hc=torch.cat([hc, out.transpose(0, 1)]))

    def forward_step(self, encoded: torch.Tensor, state: RnntState) -> torch.Tensor:
        """Decode one encoder frame per stream: ``encoded [B, 1, D]``, ``state.hc [2 * layers + 1, B, H]``
        (updated) -> ``[max_symbols, B]`` long ids (-1 = none); rows decode independently. Special pieces
        (language tags, <unk>) are returned too: they advance the prediction network, and
        :class:`TranscriptText` leaves them out of the text."""
        decoder, pred = self.decoder, self.joint.pred
        # enc(e) + pred(p) as one addmm per symbol: the frame's projection rides in the bias.
        frame_bias = self.joint.enc(encoded.reshape(encoded.shape[0], -1)) + pred.bias
        hc = state.hc
        active: torch.Tensor | None = None
        tokens, kept = [], []
        for _ in range(self.max_symbols):
            token, active, hc = _symbol_step(decoder, self.joint.joint_net, pred.weight, frame_bias, hc, active, self.blank_id)
            tokens.append(token)
            kept.append(active)
        state.hc = hc
        return torch.where(torch.stack(kept), torch.stack(tokens), -1)

    @torch.no_grad()
    def greedy_decode(self, encoded: torch.Tensor) -> list[int]:
        """Transcript ids of ``encoded`` [1, T, D] (special pieces' ids included; reads the host once)."""
        if encoded.dim() != 3 or encoded.shape[0] != 1:
            raise ValueError(f"RnntTranscriber.greedy_decode: expected encoded [1, T, D], got {tuple(encoded.shape)}")
        state = self.new_state()
        ids = torch.stack([self.forward_step(encoded[:, t:t + 1], state)[:, 0] for t in range(encoded.shape[1])])
        return [i for i in ids.flatten().tolist() if i >= 0]


def is_special_piece(piece: str) -> bool:
    """``<unk>``, ``<pad>``, ``<s>``, ``</s>`` and language tags such as ``<en-US>``."""
    return piece in _SPECIAL_PIECES or bool(_LANGUAGE_TAG.match(piece))


def decode_pieces(ids: Iterable[int], vocabulary: list[str]) -> str:
    """Join SentencePiece pieces (``\u2581`` -> space), skipping specials and ids outside the vocabulary."""
    pieces = (vocabulary[i] for i in ids if 0 <= i < len(vocabulary))
    return "".join(p.replace("\u2581", " ") for p in pieces if not is_special_piece(p))


class TranscriptText:
    """Host-side transcript: takes each frame's ids once and reports ``(delta, text)`` when it grew.

    ``text`` is ``decode_pieces(tokens).strip()``, kept incrementally: pieces only append, so a
    frame joins its own pieces and the stripped text grows at its end (trailing whitespace waits in
    ``_space`` until something follows it). ``delta`` is the new suffix of ``text``; ``update``
    returns None when the frame appended no token (blank, -1 or special pieces only).
    """

    def __init__(self, vocabulary: list[str]):
        self.vocabulary = list(vocabulary)
        self.tokens: list[int] = []
        self.text = ""
        self._space = ""  # whitespace after ``text`` in the joined pieces, kept once more text follows

    def is_special(self, token: int) -> bool:
        return 0 <= token < len(self.vocabulary) and is_special_piece(self.vocabulary[token])

    def update(self, ids: Iterable[int]) -> tuple[str, str] | None:
        new = [i for i in ids if i >= 0 and not self.is_special(i)]
        if not new:
            return None
        self.tokens.extend(new)
        tail = self._space + decode_pieces(new, self.vocabulary)
        if not self.text:
            tail = tail.lstrip()
        delta = tail.rstrip()
        self._space = tail[len(delta):] if delta or self.text else ""
        self.text += delta
        return delta, self.text


# Compiled, a symbol is a nested region (layers.layer_step): two variants (the first symbol, the
# others) instead of ``max_symbols`` copies of the same kernels.
@layer_step
def _symbol_step(decoder: RnntDecoder, joint_net: nn.Module, pred_weight: torch.Tensor, frame_bias: torch.Tensor,
                 hc: torch.Tensor, active: torch.Tensor | None, blank_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One symbol of a frame's greedy decoding: the joint's argmax ``[B]``, the rows still emitting
    (``active``: None before the first symbol) and the LSTM state, advanced where they are."""
    token = joint_net(linear(hc[-1], pred_weight, frame_bias)).argmax(dim=-1)  # [B]
    emitted = token != blank_id
    active = emitted if active is None else active & emitted
    # The candidate state is computed every time and kept only while tokens are being emitted.
    step = decoder.step(decoder.input_gates(token), hc[:2 * decoder.layers], with_output=True)
    return token, active, torch.where(active[:, None], step, hc)
