"""Verification of draft tokens against the target model: greedy acceptance (the longest
prefix equal to the target's argmax) and the rejection-sampling rule of Leviathan et al. 2023 /
Chen et al. 2023, which keeps the output distributed exactly as the target's.

Both work on a padded batch: request i drafted `num_drafts[i]` tokens into a row of width K;
its output row holds the accepted drafts followed by one more token (the target's correction
at the first rejection, or the bonus token after the last draft), then PAD_TOKEN. The request
advances by `num_accepted[i] + 1` tokens. Everything stays on the inputs' device; the only
per-request work is drawing uniforms from each request's own generator.
"""
from __future__ import annotations

import torch

PAD_TOKEN = -1  # output positions past a request's last token


def accept_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts equal to the target's argmax.

    target_logits [N, K+1, V] (position j scores the token after draft j-1), draft_tokens
    [N, K], num_drafts [N] in 0..K. Returns (output_tokens [N, K+1], num_accepted [N]).
    Ties go to the lowest token id, as the sampler's argmax does without speculation.
    """
    _check_batch(target_logits, "target_logits", draft_tokens, num_drafts)
    target_tokens = target_logits.argmax(dim=-1)
    num_draft_positions = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :num_draft_positions]) & _valid_mask(
        num_drafts, num_draft_positions)
    num_accepted = _leading_true(matches)
    # accepted drafts equal the argmax, so the argmax row is the output up to and including
    # the correction/bonus position
    positions = torch.arange(num_draft_positions + 1, device=target_tokens.device)
    output = torch.where(positions <= num_accepted[:, None], target_tokens, PAD_TOKEN)
    return output, num_accepted


def accept_sampled(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                   num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                   generators: list[torch.Generator | None], *,
                   default_generator: torch.Generator | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling: accept draft x at position j with probability min(1, p(x) / q(x));
    at the first rejection sample from norm(max(0, p - q)); after all accepted, sample the
    bonus token from the next position's p.

    target_probs [N, K+1, V] are the target's probabilities after the request's own sampling
    processors; draft_probs [N, K, V] the distributions the drafts were drawn from, or None
    for one-hot drafts (n-gram, greedy drafter: q(x) = 1, the residual is p without x).
    generators[i] seeds request i (it draws num_drafts[i] + 1 uniforms, so its result does not
    depend on the rest of the batch); rows with None draw from default_generator (torch's
    default when None). Returns (output_tokens [N, K+1], num_accepted [N]).
    """
    _check_batch(target_probs, "target_probs", draft_tokens, num_drafts)
    _check_sampled_args(target_probs, draft_tokens, draft_probs, generators)
    num_draft_positions = draft_tokens.shape[1]
    uniforms = _draw_uniforms(num_drafts, num_draft_positions, generators, default_generator,
                              target_probs.device)
    valid = _valid_mask(num_drafts, num_draft_positions)
    safe_drafts = torch.where(valid, draft_tokens, 0)  # padded drafts may be any id
    target_p = _probability_of(target_probs[:, :num_draft_positions], safe_drafts)
    if draft_probs is None:
        draft_q = torch.ones_like(target_p)
    else:
        draft_q = _probability_of(draft_probs, safe_drafts)
    # u < p / q, written without the division so q = 0 needs no special case
    accepted = (uniforms[:, 1:] * draft_q < target_p) & valid
    num_accepted = _leading_true(accepted)
    final_dist = _final_distribution(target_probs, draft_probs, safe_drafts, num_accepted,
                                     num_drafts)
    final_tokens = _sample_from(final_dist, uniforms[:, 0])
    return _assemble_output(draft_tokens, num_accepted, final_tokens), num_accepted


def _final_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        safe_drafts: torch.Tensor, num_accepted: torch.Tensor,
                        num_drafts: torch.Tensor) -> torch.Tensor:
    """Per request [N, V]: the residual max(0, p - q) at its first rejected position, or p at
    the bonus position when every draft was accepted (unnormalised)."""
    rows = torch.arange(target_probs.shape[0], device=target_probs.device)
    target_row = target_probs[rows, num_accepted].float()
    num_draft_positions = safe_drafts.shape[1]
    if num_draft_positions == 0:
        return target_row
    rejected_at = num_accepted.clamp(max=num_draft_positions - 1)
    if draft_probs is None:
        rejected_token = safe_drafts[rows, rejected_at]
        residual = target_row.scatter(1, rejected_token[:, None], 0.0)
    else:
        residual = (target_row - draft_probs[rows, rejected_at].float()).clamp(min=0.0)
    # p <= q everywhere (up to rounding) leaves no residual mass; p is then the exact answer
    no_mass = residual.sum(dim=-1, keepdim=True) <= 0
    is_bonus = (num_accepted >= num_drafts)[:, None]
    return torch.where(is_bonus | no_mass, target_row, residual)


def _sample_from(dist: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row of an unnormalised distribution. In float64,
    u * total < total for u < 1, so the token found always has mass."""
    cdf = dist.double().cumsum(dim=-1)
    points = uniforms.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, points, right=True)[:, 0]


def _assemble_output(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
                     final_tokens: torch.Tensor) -> torch.Tensor:
    num_rows, num_draft_positions = draft_tokens.shape
    positions = torch.arange(num_draft_positions + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((num_rows, 1), PAD_TOKEN,
                                                                   dtype=torch.long)], dim=1)
    output = torch.where(positions < num_accepted[:, None], padded, PAD_TOKEN)
    return torch.where(positions == num_accepted[:, None], final_tokens[:, None], output)


def _draw_uniforms(num_drafts: torch.Tensor, num_draft_positions: int,
                   generators: list[torch.Generator | None],
                   default_generator: torch.Generator | None,
                   device: torch.device) -> torch.Tensor:
    """[N, K+1] uniforms in [0, 1): column 0 for the final sample, columns 1.. for the
    acceptance tests. A seeded request draws exactly num_drafts[i] + 1 of them."""
    uniforms = torch.rand((len(generators), num_draft_positions + 1), device=device,
                          generator=default_generator)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:
        counts = num_drafts.tolist()  # one host read; sizes the per-request draws
        for i in seeded:
            uniforms[i, :counts[i] + 1] = torch.rand(counts[i] + 1, device=device,
                                                     generator=generators[i])
    return uniforms


def _probability_of(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [N, K, V] at tokens [N, K], as float32."""
    return probs.gather(2, tokens.long()[:, :, None])[:, :, 0].float()


def _valid_mask(num_drafts: torch.Tensor, num_draft_positions: int) -> torch.Tensor:
    positions = torch.arange(num_draft_positions, device=num_drafts.device)
    return positions < num_drafts[:, None]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries are True before the first False."""
    return mask.long().cumprod(dim=1).sum(dim=1)


def _check_batch(target: torch.Tensor, target_name: str, draft_tokens: torch.Tensor,
                 num_drafts: torch.Tensor) -> None:
    if target.dim() != 3 or not target.is_floating_point():
        raise ValueError(f"{target_name} must be a float tensor [N, K+1, V], "
                         f"got {tuple(target.shape)} {target.dtype}")
    num_rows, width = target.shape[:2]
    if draft_tokens.shape != (num_rows, width - 1) or draft_tokens.is_floating_point():
        raise ValueError(f"draft_tokens must be an integer tensor [{num_rows}, {width - 1}], "
                         f"got {tuple(draft_tokens.shape)} {draft_tokens.dtype}")
    if num_drafts.shape != (num_rows,) or num_drafts.is_floating_point():
        raise ValueError(f"num_drafts must be an integer tensor [{num_rows}], "
                         f"got {tuple(num_drafts.shape)} {num_drafts.dtype}")
    for name, tensor in (("draft_tokens", draft_tokens), ("num_drafts", num_drafts)):
        if tensor.device != target.device:
            raise ValueError(f"{name} is on {tensor.device}, {target_name} on {target.device}")


def _check_sampled_args(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                        draft_probs: torch.Tensor | None,
                        generators: list[torch.Generator | None]) -> None:
    num_rows, width, vocab = target_probs.shape
    if draft_probs is not None and (draft_probs.shape != (num_rows, width - 1, vocab)
                                    or draft_probs.device != target_probs.device):
        raise ValueError(f"draft_probs must be [{num_rows}, {width - 1}, {vocab}] on "
                         f"{target_probs.device}, got {tuple(draft_probs.shape)} on "
                         f"{draft_probs.device}")
    if len(generators) != num_rows:
        raise ValueError(f"generators must have one entry per request ({num_rows}), "
                         f"got {len(generators)}")
    for g in generators:
        if g is not None and g.device.type != target_probs.device.type:
            raise ValueError(f"generators must be on {target_probs.device}, got {g.device}")
