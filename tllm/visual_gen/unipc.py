"""UniPC multistep sampling (a predictor, then a corrector on the next step) for flow-matching
models, as Cosmos 3 uses it; equal to diffusers' `UniPCMultistepScheduler` with
`prediction_type="flow_prediction"` and `use_flow_sigmas=True`, step for step.

The schedule is computed in numpy with diffusers' dtypes and order of operations (float64
linspace, float32 sigmas, timesteps truncated to integers), and the update in torch with the
same float32 scalars, so the two agree to rounding. Each stream of a pipeline has its own
scheduler: the multistep history belongs to one sample tensor.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

# diffusers options that change the schedule or the update and that we do not implement.
_UNSUPPORTED_FLAGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                      "thresholding", "rescale_betas_zero_snr")


@dataclass(frozen=True)
class UniPCConfig:
    """The fields of diffusers' UniPC scheduler_config.json that matter here, with diffusers'
    defaults, except that flow prediction with flow sigmas is the only mode."""

    num_train_timesteps: int = 1000
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    flow_shift: float = 1.0
    final_sigmas_type: str = "zero"
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "disable_corrector", tuple(self.disable_corrector))
        if not (isinstance(self.solver_order, int) and 1 <= self.solver_order <= 3):
            raise ValueError(f"scheduler solver_order must be 1, 2 or 3, got {self.solver_order!r}")
        if self.solver_type not in ("bh1", "bh2"):
            raise ValueError(f"scheduler solver_type must be 'bh1' or 'bh2', got "
                             f"{self.solver_type!r}")
        if self.final_sigmas_type not in ("zero", "sigma_min"):
            raise ValueError(f"scheduler final_sigmas_type must be 'zero' or 'sigma_min', got "
                             f"{self.final_sigmas_type!r}")
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(f"scheduler time_shift_type must be 'exponential' or 'linear', "
                             f"got {self.time_shift_type!r}")

    @classmethod
    def from_dict(cls, data: dict) -> UniPCConfig:
        """From diffusers' scheduler_config.json; ValueError for a mode we do not run."""
        unsupported = [name for name in _UNSUPPORTED_FLAGS if data.get(name)]
        if data.get("prediction_type", "flow_prediction") != "flow_prediction":
            unsupported.append(f"prediction_type={data['prediction_type']!r}")
        if not data.get("use_flow_sigmas", True):
            unsupported.append("use_flow_sigmas=false")
        if not data.get("predict_x0", True):
            unsupported.append("predict_x0=false")
        if data.get("solver_type") in ("midpoint", "heun", "logrho"):
            data = {**data, "solver_type": "bh2"}      # diffusers maps these to bh2 too
        if unsupported:
            raise ValueError(f"UniPC scheduler options not supported: {', '.join(unsupported)}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items()
                      if k in names and (v is not None or k == "shift_terminal")})

    @classmethod
    def from_model_dir(cls, path: str | Path, default: UniPCConfig) -> UniPCConfig:
        file = Path(path) / "scheduler" / "scheduler_config.json"
        if not file.is_file():
            return default
        return cls.from_dict(json.loads(file.read_text()))


class UniPCScheduler:
    """UniPC with the data (x0) prediction of a flow model: x0 = x - sigma * v."""

    def __init__(self, config: UniPCConfig) -> None:
        self.config = config
        self.sigmas: torch.Tensor | None = None      # (num_steps + 1,) float32, on the host
        self.timesteps: torch.Tensor | None = None   # (num_steps,) int64
        self._reset()

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    def set_timesteps(self, num_steps: int | None = None, sigmas=None, mu: float | None = None,
                      device: torch.device | str | None = None) -> None:
        """The schedule: `sigmas` (unshifted, one per step) or linspace(1, 1/T, n + 1)[:-1];
        `mu` is required with dynamic shifting."""
        config = self.config
        if config.use_dynamic_shifting and mu is None:
            raise ValueError("mu is required: the scheduler uses dynamic shifting")
        if sigmas is None:
            base = np.linspace(1, 1 / config.num_train_timesteps, num_steps + 1)[:-1]
        else:
            base = np.array(sigmas)
        shifted = self._shift(base, mu)
        one_minus = 1 - shifted
        if config.shift_terminal and one_minus[-1] != 0:   # diffusers: 0 / 0 = NaN here
            shifted = 1 - one_minus / (one_minus[-1] / (1 - config.shift_terminal))
        if np.fabs(shifted[0] - 1) < 1e-6:     # keeps log(sigma) and log(1 - sigma) finite
            shifted[0] -= 1e-6
        timesteps = shifted * config.num_train_timesteps
        last = shifted[-1] if config.final_sigmas_type == "sigma_min" else 0
        self.sigmas = torch.from_numpy(np.concatenate([shifted, [last]]).astype(np.float32))
        self.timesteps = torch.from_numpy(timesteps).to(device=device, dtype=torch.int64)
        self._reset()

    def step(self, model_output: torch.Tensor, step_index: int,
             sample: torch.Tensor) -> torch.Tensor:
        """The sample after step `step_index` (steps must come in order from 0); sample and
        model_output carry a leading batch dim."""
        if self.timesteps is None:
            raise ValueError("set_timesteps() must run before step()")
        if step_index != self._step_index:
            raise ValueError(f"UniPC steps run in order: expected step {self._step_index}, "
                             f"got {step_index}")
        x0 = sample - self.sigmas[step_index] * model_output
        if step_index > 0 and step_index - 1 not in self.config.disable_corrector:
            sample = self._correct(x0, self._last_sample, sample, self._order)
        self._x0s = [*self._x0s[1:], x0]
        order = self.config.solver_order
        if self.config.lower_order_final:
            order = min(order, self.num_steps - step_index)
        self._order = min(order, self._num_lower_orders + 1)     # warm up the history
        self._last_sample = sample
        prev = self._predict(sample, self._order)
        self._num_lower_orders = min(self._num_lower_orders + 1, self.config.solver_order)
        self._step_index += 1
        return prev

    # ---- the update ----

    def _predict(self, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP from sigma[i] to sigma[i + 1], on the last `order` x0 predictions."""
        i = self._step_index
        m0 = self._x0s[-1]
        lambdas = self._lambdas([i + 1, i] + [i - k for k in range(1, order)], x.device)
        coeffs = _Coefficients(lambdas, order, self.config.solver_type)
        d1s = [(self._x0s[-(k + 1)] - m0) / coeffs.rks[k - 1] for k in range(1, order)]
        sigma_t, sigma_s0 = (self.sigmas[j].to(x.device) for j in (i + 1, i))
        alpha_t = 1 - sigma_t
        x_t = sigma_t / sigma_s0 * x - alpha_t * coeffs.h_phi_1 * m0
        if d1s:
            rhos = (torch.ones(1, dtype=x.dtype, device=x.device) * 0.5 if order == 2 else
                    torch.linalg.solve(coeffs.R[:-1, :-1], coeffs.b[:-1]).to(x.device).to(x.dtype))
            x_t = x_t - alpha_t * coeffs.B_h * torch.einsum("k,bk...->b...", rhos,
                                                              torch.stack(d1s, dim=1))
        else:
            x_t = x_t - alpha_t * coeffs.B_h * 0
        return x_t.to(x.dtype)

    def _correct(self, x0_t: torch.Tensor, last: torch.Tensor, this: torch.Tensor,
                 order: int) -> torch.Tensor:
        """UniC: the last step's result redone with this step's x0 prediction."""
        i = self._step_index
        m0 = self._x0s[-1]
        lambdas = self._lambdas([i, i - 1] + [i - (k + 1) for k in range(1, order)], this.device)
        coeffs = _Coefficients(lambdas, order, self.config.solver_type)
        d1s = [(self._x0s[-(k + 1)] - m0) / coeffs.rks[k - 1] for k in range(1, order)]
        rhos = (torch.ones(1, dtype=last.dtype, device=this.device) * 0.5 if order == 1 else
                torch.linalg.solve(coeffs.R, coeffs.b).to(this.device).to(last.dtype))
        sigma_t, sigma_s0 = (self.sigmas[j].to(this.device) for j in (i, i - 1))
        alpha_t = 1 - sigma_t
        x_t = sigma_t / sigma_s0 * last - alpha_t * coeffs.h_phi_1 * m0
        correction = rhos[-1] * (x0_t - m0)
        if d1s:
            correction = torch.einsum("k,bk...->b...", rhos[:-1],
                                      torch.stack(d1s, dim=1)) + correction
        return (x_t - alpha_t * coeffs.B_h * correction).to(last.dtype)

    def _lambdas(self, indexes: list[int], device) -> list[torch.Tensor]:
        """log(alpha / sigma) at the given sigma indexes (flow: alpha = 1 - sigma)."""
        out = []
        for j in indexes:
            sigma = self.sigmas[j].to(device)
            out.append(torch.log(1 - sigma) - torch.log(sigma))
        return out

    def _shift(self, sigmas: np.ndarray, mu: float | None) -> np.ndarray:
        if self.config.use_dynamic_shifting:
            odds = 1 / sigmas - 1
            if self.config.time_shift_type == "exponential":
                return math.exp(mu) / (math.exp(mu) + odds)
            return mu / (mu + odds)
        shift = self.config.flow_shift
        return shift * sigmas / (1 + (shift - 1) * sigmas)

    def _reset(self) -> None:
        self._x0s: list[torch.Tensor | None] = [None] * self.config.solver_order
        self._num_lower_orders = 0
        self._last_sample: torch.Tensor | None = None
        self._order = 0
        self._step_index = 0


class _Coefficients:
    """The B(h) solver's coefficients from lambda at (target, source, older sources...)."""

    def __init__(self, lambdas: list[torch.Tensor], order: int, solver_type: str) -> None:
        lambda_t, lambda_s0, *older = lambdas
        h = lambda_t - lambda_s0
        self.rks = [(lambda_si - lambda_s0) / h for lambda_si in older]
        rks = torch.stack([*self.rks, torch.ones((), device=h.device)])
        hh = -h
        self.h_phi_1 = torch.expm1(hh)
        self.B_h = hh if solver_type == "bh1" else torch.expm1(hh)
        h_phi_k = self.h_phi_1 / hh - 1
        factorial = 1
        R, b = [], []
        for k in range(1, order + 1):
            R.append(torch.pow(rks, k - 1))
            b.append(h_phi_k * factorial / self.B_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        self.R = torch.stack(R)
        self.b = torch.stack(b)
