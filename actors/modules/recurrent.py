"""The LSTM step shared by the recurrent modules (``model_config`` ``use_lstm``): states are ``[B, 2, cell]``
arrays (hidden and cell state), zeros at an episode's start."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


def zero_states(n: int, cell: int) -> np.ndarray:
    """``n`` fresh recurrent states ``[n, 2, cell]``, float32."""
    return np.zeros((n, 2, cell), np.float32)


def unroll(lstm: nn.LSTM, feats: torch.Tensor, state: torch.Tensor | None,
           lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``lstm`` over ``feats`` ``[B, T, dim]`` from ``state`` ``[B, 2, cell]`` (None: zeros): outputs ``[B, T, cell]``
    and the state after the last step -- or, with ``lengths`` ``[B]``, after each row's own last real step (a row
    of length 0 keeps ``state``; its outputs are zeros). ValueError for a state of the wrong shape."""
    cell = lstm.hidden_size
    if state is None:
        state = torch.zeros((feats.shape[0], 2, cell), device=feats.device)
    want = (feats.shape[0], 2, cell)
    if tuple(state.shape) != want:
        raise ValueError(f"recurrent state of shape {tuple(state.shape)}; this module takes {want} "
                         f"(rows, hidden and cell, lstm_cell_size)")
    h0, c0 = (state[:, i].unsqueeze(0).contiguous() for i in (0, 1))
    if lengths is None:
        out, (h, c) = lstm(feats, (h0, c0))
        return out, torch.stack([h[0], c[0]], 1)
    packed = nn.utils.rnn.pack_padded_sequence(feats, lengths.clamp(min=1).cpu(), batch_first=True,
                                               enforce_sorted=False)
    out, (h, c) = lstm(packed, (h0, c0))
    out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=feats.shape[1])
    some = (lengths > 0)[:, None, None]
    return out * some, torch.where(some, torch.stack([h[0], c[0]], 1), state)
