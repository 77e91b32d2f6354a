"""Recurrent DQN (R2D2, Kapturowski et al. 2019): the loss on replayed sequences.

DQN with ``model_config={"use_lstm": True}`` replays whole sequences (``actors.replay.sequences``): the
chunks the runners cut, at most ``max_seq_len`` steps each, with the recurrent state stored at their start.
For each sequence the online and the target network unroll from that stored state; with ``burn_in`` both
first run without gradients over the chunk before it in its episode (from that chunk's stored state), so the
state the loss starts from is the current network's rather than the stale stored one (R2D2's burn-in; a
sequence without a stored previous chunk starts from its own stored state). Every step is trained; its target is its n-step return inside the sequence (never past its end; the sequence's last
observation is the bootstrap observation) plus the discounted target network's value of the online
network's best action there (double Q); 0 after a terminal step. Priorities: R2D2's mix of a sequence's
TD errors (``sequence_priorities``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from actors.modules import QModule

PRIORITY_ETA = 0.9
"""R2D2's weight of a sequence's largest TD error in its priority (the rest: the mean)."""


def h_rescale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """R2D2's invertible value rescaling h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x (Pohlen et al. 2018): the
    network learns h of the returns, which keeps large rewards from dominating the loss."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1) - 1) + eps * x


def h_inverse(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The inverse of ``h_rescale``."""
    return torch.sign(x) * (((torch.sqrt(1 + 4 * eps * (x.abs() + 1 + eps)) - 1) / (2 * eps)) ** 2 - 1)


def sequence_n_step(rewards: torch.Tensor, lengths: torch.Tensor, terminated: torch.Tensor, n_steps: torch.Tensor,
                    gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """n-step returns of every step of padded sequences.

    ``rewards`` ``[B, T]`` (zeros past each sequence's length), ``lengths`` ``[B]``, ``terminated`` ``[B]`` (the
    episode ended in a terminal state at the sequence's last step), ``n_steps`` ``[B]``. Returns, each
    ``[B, T]``: the discounted sums of up to n rewards (fewer near the sequence's end), the index of the
    bootstrap observation, its discount (``gamma ** steps used``, 0 when that observation is the terminal one)
    and the mask of real steps."""
    b, t = rewards.shape
    pos = torch.arange(t, device=rewards.device)[None, :]
    used = torch.minimum(n_steps[:, None], lengths[:, None] - pos).clamp(min=0)  # [B, T]
    valid = used > 0
    padded = torch.cat([rewards, rewards.new_zeros(b, int(n_steps.max()))], 1)
    returns = torch.zeros(b, t, dtype=torch.float32, device=rewards.device)
    for i in range(int(n_steps.max())):
        returns = returns + (gamma ** i) * padded[:, i:i + t] * (i < used)
    boot = pos + used  # the observation after the last step used
    ends_terminal = (boot == lengths[:, None]) & terminated[:, None]
    discounts = torch.where(ends_terminal | ~valid, torch.zeros((), device=rewards.device),
                            torch.pow(torch.full((), gamma, device=rewards.device), used.float()))
    return returns, boot, discounts, valid


def r2d2_loss(module: QModule, target: QModule, batch: dict[str, Any], gamma: float, burn_in: bool = False,
              td_error_loss_fn: str = "huber", double_q: bool = True, h_epsilon: float | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The loss on a batch of sequences (``SequenceReplay.sample`` as tensors; with ``burn_in``, its ``burn_*``
    keys too); returns ``(loss, stats, |TD error| [B, T], trained-step mask [B, T])``. Each sequence's mean step
    loss is weighted by its importance weight; MultiDiscrete branches are trained against their own targets and
    averaged. ``h_epsilon``: the Q-values are h-rescaled returns (``h_rescale``), the target
    ``h(G + discount * h^-1(Q_target))``."""
    obs, state = batch["obs"], batch["state_in"]
    if burn_in:
        with torch.no_grad():
            args = (batch["burn_obs"], batch["burn_state"], batch["burn_lengths"])
            online_state = module.forward_sequences(*args)["state_out"]
            target_state = target.forward_sequences(*args)["state_out"]
    else:
        online_state = target_state = state
    online = module.forward_sequences(obs, online_state)
    with torch.no_grad():
        tgt = target.forward_sequences(obs, target_state)
    returns, boot, discounts, valid = sequence_n_step(batch["rewards"], batch["lengths"], batch["terminated"],
                                                      batch["n_steps"], gamma)
    width = returns.shape[1]
    actions = batch["actions"].long().reshape(returns.shape[0], width, -1)
    mask = online.get("action_mask")

    def at_boot(x: torch.Tensor) -> torch.Tensor:  # [B, T+1, n] -> the bootstrap rows [B, T, n]
        return x.gather(1, boot[..., None].expand(-1, -1, x.shape[-1]))

    losses, td_abs = [], []
    for branch, (q, tq) in enumerate(zip(online["branch_logits"], tgt["branch_logits"])):
        q_taken = q[:, :width].gather(2, actions[:, :, branch:branch + 1]).squeeze(2)
        with torch.no_grad():
            select = at_boot(q.detach() if double_q else tq)
            if mask is not None:  # only legal bootstrap actions (a row with none keeps all: its discount is 0)
                legal = at_boot(_branch_mask(module, mask, branch).float()).bool()
                select = torch.where(legal | ~legal.any(-1, keepdim=True), select, torch.finfo(select.dtype).min)
            best = select.argmax(-1, keepdim=True)
            boot_value = at_boot(tq).gather(2, best).squeeze(2)
            if h_epsilon is None:
                y = returns + discounts * boot_value
            else:
                y = h_rescale(returns + discounts * h_inverse(boot_value, h_epsilon), h_epsilon)
        td = y - q_taken
        per_step = F.huber_loss(q_taken, y, reduction="none") if td_error_loss_fn == "huber" else 0.5 * td.pow(2)
        per_seq = (per_step * valid).sum(1) / valid.sum(1).clamp(min=1)
        losses.append((batch["weights"] * per_seq).mean())
        td_abs.append(td.detach().abs())
    loss = torch.stack(losses).mean()
    td = torch.stack(td_abs).mean(0)
    taken = q_taken.detach()[valid] if bool(valid.any()) else q_taken.new_zeros(1)  # all within burn-in: none
    stats = {"qf_loss": loss.detach(), "qf_mean": taken.mean(), "qf_min": taken.min(), "qf_max": taken.max(),
             "td_error_mean": td[valid].mean(), "num_steps_trained_per_sequence": valid.sum(1).float().mean()}
    return loss, stats, td, valid


def _branch_mask(module: QModule, mask: torch.Tensor, branch: int) -> torch.Tensor:
    """The action mask's columns of one branch ``[..., n_branch]``."""
    lo = sum(module.branches[:branch])
    return mask[..., lo:lo + module.branches[branch]]


def sequence_priorities(td_abs: torch.Tensor, valid: torch.Tensor, eta: float = PRIORITY_ETA) -> torch.Tensor:
    """R2D2's priority of each sequence from its steps' absolute TD errors and the mask of the steps trained
    (both ``[B, T]``): ``eta * max + (1 - eta) * mean`` over those steps (0 for a sequence with none)."""
    td = torch.where(valid, td_abs, torch.zeros((), device=td_abs.device))
    count = valid.sum(1)
    return eta * td.max(1).values + (1 - eta) * td.sum(1) / count.clamp(min=1)
