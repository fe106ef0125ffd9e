r"""AdamW over one flat buffer, for training: :class:`refmath.optim.AdamW` bit for bit.

:class:`refmath.optim.AdamW` updates one parameter at a time, each equation one line of NumPy:
the form to read, the lessons' and the ``losses_optim`` assignment's. Training pays for that form
in a Python loop over dozens of tensors, each operation allocating a temporary. :class:`FlatAdamW`
keeps every parameter, gradient and moment in one contiguous buffer and updates it in a few
vectorised calls per cache-sized block, with the same operations in the same order, so that its
parameters and moments are those of :class:`~refmath.optim.AdamW` exactly (catalogue O4).

Where the compiled extension is built, the step runs :func:`refmath.kernels.adamw_step`, one C++
pass over the buffer doing the NumPy form's operations (:func:`_adamw_part`) element by element,
with the same roundings; the NumPy form stays the definition, and runs without the extension.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from refmath import kernels
from refmath._validate import check_choice, check_int, check_real, check_same_shape, float_array
from refmath.optim import AdamW

__all__ = ["FlatAdamW", "BACKENDS"]

# Who runs the update: NumPy (the form to read, :func:`_adamw_part`) or the C++ kernel
# (:func:`refmath.kernels.adamw_step`, the same operations in one pass).
BACKENDS = ("numpy", "cpu")

# Bytes of each array per block of FlatAdamW's update. At 128 KiB the six arrays a block touches
# (p, g, m, v and two scratch arrays, 768 KiB) stay in a core's L2 cache through the fifteen
# passes NumPy makes over them, so only the first read of p, g, m, v and the last write of p, m, v
# go further out. Much smaller blocks pay NumPy's cost per call (about half a microsecond, fifteen
# calls per block) more often; much larger ones fall out of L2 between passes. With several
# threads every call also hands the GIL over, so blocks are larger there. Measured on the GPT of
# benchmarks/train_step.py: 128 KiB is the fastest on one thread, 512 KiB on two.
_BLOCK_BYTES = 1 << 17
_THREADED_BLOCK_BYTES = 1 << 19


def _adamw_part(pieces, blocks, sources, constants) -> None:
    """One thread's share of a FlatAdamW step: copy in the gradients of its stretch of the buffer
    from ``sources`` (flat gradients by name), then AdamW's update over its ``blocks``, operation
    for operation."""
    for name, lo, hi, view in pieces:
        if name in sources:
            view[...] = sources[name][lo:hi]
    b1, c1, b2, c2, bc1, bc2, eta, eps, shrink = constants
    mul, add, div = np.multiply, np.add, np.divide
    for p, g, m, v, a, b, wd in blocks:
        mul(m, b1, out=m)  # m = b1 m + (1 - b1) g
        mul(g, c1, out=a)
        add(m, a, out=m)
        mul(g, g, out=a)  # v = b2 v + (1 - b2) (g g)
        mul(a, c2, out=a)
        mul(v, b2, out=v)
        add(v, a, out=v)
        div(m, bc1, out=a)  # a = lr m_hat
        mul(a, eta, out=a)
        div(v, bc2, out=b)  # b = sqrt(v_hat) + eps
        np.sqrt(b, out=b)
        add(b, eps, out=b)
        div(a, b, out=a)
        if wd:
            mul(p, shrink[wd], out=p)  # O4: the decay, before the Adam step as in AdamW
        np.subtract(p, a, out=p)


class FlatAdamW(AdamW):
    r"""AdamW (catalogue O4) with every parameter, gradient and moment in one contiguous buffer.

    The update is :class:`AdamW`'s, element for element and operation for operation:

    .. math::
        m \leftarrow \beta_1 m + (1-\beta_1)\, g,\qquad
        v \leftarrow \beta_2 v + (1-\beta_2)\,(g \odot g),

        \theta \leftarrow (1-\eta\lambda)\,\theta
            - \frac{\eta\,\big(m / (1-\beta_1^s)\big)}{\sqrt{v / (1-\beta_2^s)} + \epsilon}

    evaluated in the same order with the same roundings (each constant rounded once to the
    parameters' dtype, as NumPy rounds a Python float next to an array of that dtype), so the
    parameters and moments are *bit for bit* those of :class:`AdamW` given the same gradients and
    learning rates, in float32 and float64. :class:`AdamW` stays the form to read; this one is
    for training, where a Python loop over dozens of tensors, each operation allocating a
    temporary, costs more than the arithmetic.

    **The caller's dict then holds views.** On construction every array of ``params`` is copied
    into one 1-D buffer, and each entry of the caller's dict is replaced by a view into it (same
    name, shape, dtype and values). The dict keeps working as the model's parameters, and the
    optimiser updates the buffer, and so the views, in place. An entry must therefore never be
    re-assigned: after ``params[name] = new_array`` the optimiser would go on updating the buffer
    and the model would read an array nobody trains, so :meth:`step` checks that the dict it is
    given holds its views and refuses anything else. Writing into a view
    (``params[name][...] = x``) is fine. All parameters must share one floating dtype.

    The moments ``m`` and ``v`` and a gradient buffer ``g`` share the layout. The parameters are
    laid out grouped by their weight-decay coefficient (O5: :meth:`decay_of`, asked once, here),
    so that the decay :math:`(1-\eta\lambda)` is one multiplication per group and block.
    A backward pass may write its gradients straight into the views ``self.grads[name]``; a
    gradient given as another array is read where it lies.

    Two backends do the update, with the same operations in the same order and the same bits.
    ``"numpy"``: :meth:`step` copies the gradients into ``g`` and updates the buffer block by block,
    fifteen NumPy calls with ``out=`` per block and no temporary allocated; NumPy's element-wise
    calls run on one core, so ``threads`` splits the buffer into that many stretches, updated at
    once on a thread pool (NumPy lets go of the GIL inside each call). ``"cpu"``: one call of the
    C++ kernel :func:`refmath.kernels.adamw_step`, which reads each gradient in place and makes one
    pass over the buffer (28 bytes per float32 parameter), on ``threads`` OpenMP threads; after
    its step ``g`` holds only what was written there. ``backend=None`` (the default) picks
    ``"cpu"`` where the compiled extension is built and ``"numpy"`` elsewhere.

    ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``decay_of`` are :class:`AdamW`'s; ``threads``
    (default 1) is the number of threads that update the buffer. The attributes ``params``,
    ``grads``, ``state["m"]`` and ``state["v"]`` are ``{name: view}`` dicts in the order of the
    caller's dict. :meth:`state_dict` and :meth:`load_state_dict` use
    :class:`AdamW`'s keys (``"step"``, ``"m.<name>"``, ``"v.<name>"``, no moments before the
    first step), so a state saved by either class loads into the other.
    """

    def __init__(self, params: dict, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, decay_of=None, threads: int = 1,
                 backend: str | None = None):
        super().__init__(lr, betas, eps, weight_decay, decay_of)
        self.threads = check_int("threads", threads, 1, 256)
        if backend is None:
            backend = "cpu" if kernels.cpu_available() else "numpy"
        self.backend = check_choice("backend", backend, BACKENDS)
        if backend == "cpu" and not kernels.cpu_available():
            raise ImportError("FlatAdamW(backend='cpu') needs the compiled extension refmath._C, "
                              "which is not built here; use backend='numpy' (or None)")
        if not isinstance(params, dict) or not params:
            got = "an empty dict" if isinstance(params, dict) else type(params).__name__
            raise TypeError(f"params must be a non-empty dict of name -> ndarray, got {got}")
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or p.dtype.kind != "f":
                raise TypeError(f"params[{name!r}] must be a floating-point ndarray, got "
                                f"{type(p).__name__} {getattr(p, 'dtype', '')}")
        dtypes = {}
        for name, p in params.items():
            dtypes.setdefault(str(p.dtype), name)
        if len(dtypes) > 1:
            raise TypeError("params must share one dtype to live in one buffer, got "
                            + ", ".join(f"{d} ({n!r} ...)" for d, n in sorted(dtypes.items())))
        dtype = next(iter(params.values())).dtype
        decays = {name: self.decay_of(name) for name in params}
        order = sorted(params, key=lambda name: decays[name])  # stable: dict order in a group
        spans, start = {}, 0
        for name in order:
            spans[name] = (start, start + params[name].size)
            start += params[name].size
        self._buffers = {"p": np.empty(start, dtype), "g": np.zeros(start, dtype),
                         "m": np.zeros(start, dtype), "v": np.zeros(start, dtype)}
        views = {key: {name: flat[spans[name][0]:spans[name][1]].reshape(params[name].shape)
                       for name in params}
                 for key, flat in self._buffers.items()}
        for name in params:
            views["p"][name][...] = params[name]
            params[name] = views["p"][name]
        self.params, self.grads = views["p"], views["g"]
        self.state = {"m": views["m"], "v": views["v"]}
        self._decays = sorted({wd for wd in decays.values() if wd})
        self._parts = self._make_parts(order, spans, decays)
        # The kernel's pieces in buffer order: each parameter's name, the flat view of its
        # gradient in the buffer, and its decay coefficient.
        self._piece_names = order
        self._piece_grads = [self._buffers["g"][slice(*spans[name])] for name in order]
        self._piece_decays = [decays[name] for name in order]
        numpy_threads = len(self._parts) > 1 and backend == "numpy"
        self._pool = ThreadPoolExecutor(len(self._parts) - 1) if numpy_threads else None

    def _make_parts(self, order, spans, decays) -> list[tuple[list, list]]:
        """``(pieces, blocks)`` per thread: consecutive stretches of the buffer of about equal length.

        ``pieces``, ``(name, lo, hi, view)``: the elements ``lo:hi`` of gradient ``name``, flat,
        belong in ``view`` of the gradient buffer. ``blocks``, ``(p, g, m, v, a, b, wd)``: views of
        at most a block's bytes of each array within one run of parameters sharing a decay
        coefficient ``wd``; ``a`` and ``b`` are the thread's two scratch arrays.
        """
        flat = self._buffers["p"]
        block_bytes = _BLOCK_BYTES if self.threads == 1 else _THREADED_BLOCK_BYTES
        length = max(1, block_bytes // flat.itemsize)
        runs: list[list] = []  # [lo, hi, wd]
        for name in order:
            lo, hi = spans[name]
            if runs and runs[-1][2] == decays[name]:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi, decays[name]])
        cuts = [(i, min(i + length, hi), wd) for lo, hi, wd in runs for i in range(lo, hi, length)]
        n_parts = min(self.threads, len(cuts))
        ranges: list[list] = [[] for _ in range(n_parts)]
        for i, j, wd in cuts:  # a block goes to the part its first element falls in
            ranges[i * n_parts // flat.size].append((i, j, wd))
        parts = []
        for part in filter(None, ranges):  # a part may get no block
            start, end = part[0][0], part[-1][1]
            pieces = [(name, max(lo, start) - lo, min(hi, end) - lo,
                       self._buffers["g"][max(lo, start):min(hi, end)])
                      for name, (lo, hi) in spans.items() if lo < end and hi > start]
            a, b = (np.empty(max(j - i for i, j, _ in part), flat.dtype) for _ in range(2))
            parts.append((pieces, [(*(self._buffers[key][i:j] for key in "pgmv"),
                                    a[:j - i], b[:j - i], wd) for i, j, wd in part]))
        return parts

    def step(self, params: dict, grads: dict, lr: float | None = None) -> None:
        """Update the buffer, and so ``params`` (which must hold this optimiser's views), from
        ``grads`` (the same names and shapes, the parameters' dtype).

        ``lr`` overrides the learning rate for this step only. Everything is checked before
        anything changes.
        """
        lr = self.lr if lr is None else check_real("lr", lr, 0.0)
        self._check_params(params)
        grads = self._check_grads(grads)
        self.step_count += 1
        if self.backend == "cpu":
            return self._kernel_step(lr, grads)
        # each thread copies the gradients of its stretch, flat (a view unless g is not contiguous)
        sources = {name: g.reshape(-1) for name, g in grads.items() if g is not self.grads[name]}
        self._update_buffer(lr, sources)

    def _check_params(self, params) -> None:
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be the dict this FlatAdamW was built on, got "
                            f"{type(params).__name__}")
        if params.keys() != self.params.keys():
            missing = sorted(self.params.keys() - params.keys())
            new = sorted(params.keys() - self.params.keys())
            raise ValueError(f"the parameters must stay the same across steps: missing {missing}, "
                             f"new {new}")
        for name, view in self.params.items():
            if params[name] is not view:
                raise ValueError(
                    f"params[{name!r}] is not the view into the optimiser's buffer it was given at "
                    f"construction (was the entry re-assigned?): the update would go to the buffer "
                    f"and never reach this array. Write into the view, params[name][...] = x, "
                    f"instead of assigning a new array")

    def _check_grads(self, grads) -> dict[str, np.ndarray]:
        for name, p in self.params.items():
            if name not in grads:
                raise ValueError(f"grads has no entry for parameter {name!r} (shape {p.shape})")
        extra = sorted(set(grads) - set(self.params))
        if extra:
            raise ValueError(f"grads has entries for names that are not parameters: {extra}")
        dtype = self._buffers["p"].dtype
        checked = {}
        for name, p in self.params.items():
            g = grads[name]
            # The usual case first, without building the names of the messages.
            if type(g) is not np.ndarray or g.dtype != dtype or g.shape != p.shape:
                g = float_array(f"grads[{name!r}]", g)
                check_same_shape(f"params[{name!r}]", p, f"grads[{name!r}]", g)
                if g.dtype != dtype:
                    raise TypeError(f"grads[{name!r}] must have the parameters' dtype {dtype}, got "
                                    f"{g.dtype} (shape {g.shape})")
            checked[name] = g
        return checked

    def _constants(self, lr: float) -> tuple:
        """``(b1, 1 - b1, b2, 1 - b2, 1 - b1^s, 1 - b2^s, lr, eps, {wd: 1 - lr wd})``, each rounded
        to the buffer's dtype once, as NumPy rounds the Python float of AdamW's expressions next to
        an array of that dtype: the same values, so the same results."""
        real = self._buffers["p"].dtype.type
        beta1, beta2 = self.betas
        s = self.step_count
        shrink = {wd: real(1 - lr * wd) for wd in self._decays}
        return (real(beta1), real(1 - beta1), real(beta2), real(1 - beta2),
                real(1 - beta1**s), real(1 - beta2**s), real(lr), real(self.eps), shrink)

    def _kernel_step(self, lr: float, grads: dict) -> None:
        *scalars, shrink = self._constants(lr)
        shrink[0.0] = 1  # no decay: p * 1 is p, bit for bit, the multiplication NumPy skips
        sources = []
        for name, in_buffer in zip(self._piece_names, self._piece_grads):
            g = grads[name]
            if g is not self.grads[name]:
                in_buffer = g.reshape(-1)  # a view of a contiguous gradient, else a C-order copy
                if not in_buffer.flags.aligned:  # (a view into a byte buffer, say)
                    in_buffer = in_buffer.copy()
            sources.append(in_buffer)
        b = self._buffers
        kernels.adamw_step(b["p"], sources, b["m"], b["v"], [shrink[wd] for wd in self._piece_decays],
                           scalars, self.threads)

    def _update_buffer(self, lr: float, sources: dict) -> None:
        constants = self._constants(lr)
        others = [self._pool.submit(_adamw_part, *part, sources, constants)
                  for part in self._parts[1:]]
        for part in self._parts[:1]:  # none when every parameter is empty
            _adamw_part(*part, sources, constants)
        for other in others:
            other.result()

    def state_dict(self) -> dict[str, np.ndarray]:
        """:class:`AdamW`'s state dict, ``{"step": s, "m.<name>": array, "v.<name>": array}``
        (copies), with no moments before the first step, as :class:`AdamW` has none then."""
        if self.step_count == 0:
            return {"step": np.array(0)}
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Copy a :meth:`state_dict` of this class or of :class:`AdamW` into the buffers.

        Each moment covers every parameter or none (none: zeros, the moments of an
        :class:`AdamW` that has not stepped); shapes and dtype must be the parameters'.
        Everything is checked before anything changes.
        """
        if "step" not in state:
            raise ValueError("state has no 'step' entry")
        step = np.asarray(state["step"])
        if step.shape != () or step.dtype.kind not in "iu" or int(step) < 0:
            raise ValueError(f"state['step'] must be an integer >= 0, got {state['step']!r}")
        given: dict[str, dict[str, np.ndarray]] = {"m": {}, "v": {}}
        for key, value in state.items():
            if key == "step":
                continue
            buffer, _, name = key.partition(".")
            if buffer not in given or not name:
                raise ValueError(f"unknown state entry {key!r}: expected 'step' or "
                                 f"'<buffer>.<name>' with a buffer in {list(given)}")
            given[buffer][name] = np.asarray(value)
        for buffer, arrays in given.items():
            if arrays and arrays.keys() != self.params.keys():
                missing = sorted(self.params.keys() - arrays.keys())
                unknown = sorted(arrays.keys() - self.params.keys())
                raise ValueError(f"the state's {buffer!r} entries must cover every parameter or "
                                 f"none: missing {missing[:6]}, not parameters {unknown[:6]}")
            for name, a in arrays.items():
                view = self.state[buffer][name]
                if a.shape != view.shape or a.dtype != view.dtype:
                    raise ValueError(f"state['{buffer}.{name}'] must have shape {view.shape} and "
                                     f"dtype {view.dtype}, got shape {a.shape} and dtype {a.dtype}")
        for buffer, arrays in given.items():
            for name, view in self.state[buffer].items():
                view[...] = arrays[name] if arrays else 0
        self.step_count = int(step)
