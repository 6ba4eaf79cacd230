"""``BatchNorm``: a batch-norm layer that owns its parameters, running statistics and the
state its backward needs, with ``torch.nn.BatchNorm1d/2d/3d``'s semantics.

Reference: PyTorch ``torch/nn/modules/batchnorm.py`` (``_NormBase``, ``_BatchNorm.forward``).
Each pass is one call of the array API; the running statistics are updated in place by the
training forward itself.
"""

import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, NamedTuple

import numpy as np

from ..api import batch_norm_backward, batch_norm_forward_inference, batch_norm_forward_training
from ..arrays import common_place, operand
from ..arrays.operand import Operand, refuse_unwritable
from ..enums import DataType, Status
from ..errors import InfiniError, raises_only_infini_errors
from ..ops.validation import check_eps, check_fraction
from . import libraries

_public = raises_only_infini_errors({})
FUSIONS = (None, "relu", "add_relu")
PER_CHANNEL = ("weight", "bias", "running_mean", "running_var")  # torch's state order
_MOST_FEATURES = sys.maxsize // 8  # channels whose float64 arrays NumPy can make
Backward = Callable[[Any], tuple[Any, ...]]


def add_relu(output: Any, z: Any) -> Any:
    """``relu(output [+ z])``, in place on ``output`` (a pass's fresh result)."""
    if z is not None:
        output += z
    output[output < 0] = 0
    return output


def check_like_input(name: str, array: Any, input: Any) -> None:
    """``array`` (argument ``name``; None passes) is like ``input``: same library, device,
    shape and dtype. For the arrays the layer combines itself (a residual ``z``, a fused
    output's ``grad_output``), before anything is written."""
    if array is None:
        return
    common_place({"input": input, name: array})
    x, a = operand("input", input).desc, operand(name, array).desc
    if (a.shape, a.dtype) != (x.shape, x.dtype) or libraries.library(name, array) != (
        libraries.library("input", input)
    ):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name} must be an array like input: {x.dtype.name} {x.shape}, "
            f"got {a.dtype.name} {a.shape}",
        )


def writable(name: str, array: Any) -> Operand:
    """The door's operand of one of the layer's arrays that it writes in place (a parameter,
    statistic or gradient the caller may have set): BAD_PARAM naming it where it is not
    writable, as the array API refuses one, before anything is written."""
    op = operand(name, array, written=True)
    refuse_unwritable(name, op)
    return op


def check_addend(name: str, total: Any, grad: Any) -> None:
    """``total`` (the layer's ``weight_grad`` or ``bias_grad``, which the caller may have set)
    can have ``grad`` added in place: a writable float array of its library, device and
    shape (any float dtype, as ``+=`` takes one). For both sums, before either is made."""
    like = "this backward's gradient"
    common_place({like: grad, name: total})
    op, wanted = writable(name, total), operand(like, grad).desc
    lib, wanted_lib = libraries.library(name, total), libraries.library(like, grad)
    if (lib, op.desc.shape) != (wanted_lib, wanted.shape):
        raise InfiniError(
            Status.BAD_PARAM,
            f"{name} must be a {wanted_lib} array of shape {wanted.shape} to add {like} to, "
            f"got a {lib} array of shape {op.desc.shape}",
        )


def state_version(state: Mapping) -> int:
    """torch's version of a state: its ``_metadata``'s (2 for a torch module's own
    ``state_dict()``), 0 for a plain mapping."""
    try:
        return int(state._metadata[""]["version"])
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0


def wanted(weight: Any, bias: Any) -> tuple[bool, bool, bool]:
    """A backward's ``output_mask``: ``grad_input``, and the gradients of the parameters the
    forward had (torch's: none for a None weight or bias)."""
    return True, weight is not None, bias is not None


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as torch's: the names it lacked and those it left."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class BatchNorm:
    """Batch norm over ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` (NCHW or channels-last) and
    ``(N, C, D, H, W)`` NumPy arrays, CuPy arrays or torch tensors.

    As ``torch.nn.BatchNorm2d(num_features, eps, momentum, affine, track_running_stats)``:
    ``training`` (``train()``/``eval()``) picks the batch statistics (the running ones moved
    by ``momentum``, or by ``1/num_batches_tracked`` when ``momentum`` is None, while
    ``track_running_stats``) or the running statistics; without running statistics
    (``track_running_stats=False``, or both set to None) eval uses the batch's too;
    ``affine=False`` has no ``weight``/``bias``, ``bias=False`` (torch 2.13's) no ``bias``,
    and a parameter absent has no gradient. A per-channel array set to None is gone, as
    torch's None parameter or buffer (also before the first forward). ``fusion`` ``"relu"``
    or ``"add_relu"`` makes ``forward(input, z)`` return ``relu(bn(input) [+ z])``.

    ``weight``, ``bias``, ``running_mean`` and ``running_var`` are arrays of the input's
    library on its device, float32 (float64 for float64 input): made on the first
    ``forward``, or at once from ``like=`` (an array of that library, device and dtype).
    ``backward(grad_output)`` is the gradient of the last ``forward``: it returns
    ``grad_input`` (and ``grad_z`` for ``"add_relu"``) and adds to ``weight_grad`` and
    ``bias_grad`` (None until a backward, and after ``zero_grad()``). A failing call
    raises ``InfiniError`` and changes nothing.
    """

    DIMS: tuple[int, ...] | None = None  # the input dimensions taken; None: 2 to 5

    @_public
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        fusion: str | None = None,
        *,
        bias: bool = True,
        like: Any = None,
    ) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int | np.integer):
            raise InfiniError(
                Status.BAD_PARAM, f"num_features must be an int, got {num_features!r}"
            )
        if not 0 < num_features <= _MOST_FEATURES:
            raise InfiniError(
                Status.BAD_PARAM,
                f"num_features must be from 1 to {_MOST_FEATURES} (its float64 arrays must fit the "
                f"address space), got {num_features}",
            )
        if fusion not in FUSIONS:
            raise InfiniError(
                Status.BAD_PARAM, f"fusion must be None, 'relu' or 'add_relu', got {fusion!r}"
            )
        self.num_features = int(num_features)
        self.eps = check_eps(eps)
        self.momentum = None if momentum is None else check_fraction("momentum", momentum)
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        self._has_bias = bool(bias)
        self.fusion = fusion
        self.training = True
        self.num_batches_tracked: int | None = 0 if self.track_running_stats else None
        self.weight_grad: Any = None
        self.bias_grad: Any = None
        self.weight = self.bias = self.running_mean = self.running_var = None
        # Until the arrays exist: their values on the host, made in the first input's library.
        self._pending: dict[str, np.ndarray] | None = {
            name: np.full(self.num_features, value) for name, value in self.defaults().items()
        }
        self._place: tuple[str, str] | None = None
        self._backward: Backward | None = None
        if like is not None:
            self._commit(*self._arrays_for("like", like))

    def defaults(self) -> dict[str, float]:
        """The per-channel arrays a new layer of these flags has, and their initial value
        (torch's)."""
        names = {}
        if self.affine:
            names["weight"] = 1.0
            if self._has_bias:  # torch's bias=False: a weight alone
                names["bias"] = 0.0
        if self.track_running_stats:
            names.update(running_mean=0.0, running_var=1.0)
        return names

    def _present(self) -> list[str]:
        """The per-channel arrays the layer has now, in torch's order: those not None (before
        the first forward, those it will make)."""
        if self._pending is not None:
            return list(self._pending)
        return [name for name in PER_CHANNEL if getattr(self, name) is not None]

    def __setattr__(self, name: str, value: Any) -> None:
        """As torch's ``Module``: a per-channel array set to None is gone (not in the state,
        not used); before the first forward, it is then not made."""
        pending = self.__dict__.get("_pending")
        if value is None and pending is not None:
            pending.pop(name, None)
        object.__setattr__(self, name, value)

    def extra_repr(self) -> str:
        """torch's ``extra_repr`` (``bias`` whether the layer has one), then ``fusion`` when
        fused."""
        fusion = f", fusion={self.fusion!r}" if self.fusion else ""
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, bias={'bias' in self._present()}, "
            f"track_running_stats={self.track_running_stats}{fusion}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __getstate__(self) -> dict[str, Any]:
        """The layer without its pending backward (a closure over the last forward's arrays),
        so that it pickles and copies as torch's modules do, without their autograd graph."""
        return self.__dict__ | {"_backward": None}

    # --- modes and gradients ----------------------------------------------------------------

    @_public
    def train(self, mode: bool = True) -> "BatchNorm":
        """Training mode (batch statistics) or, with ``mode=False``, eval mode; ``mode`` a
        bool, as torch's ``Module.train`` takes it."""
        if not isinstance(mode, bool):
            raise InfiniError(Status.BAD_PARAM, f"mode must be True or False, got {mode!r}")
        self.training = mode
        return self

    def eval(self) -> "BatchNorm":
        """Eval mode: the running statistics (the batch's without ``track_running_stats``)."""
        return self.train(False)

    @_public
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated ``weight_grad``/``bias_grad``: None (torch's default) or,
        with ``set_to_none=False``, zeros in place (torch's too), both checked writable
        before either is zeroed."""
        if set_to_none:
            self.weight_grad = self.bias_grad = None
            return
        grads = [(n, getattr(self, n)) for n in ("weight_grad", "bias_grad")]
        grads = [(name, grad) for name, grad in grads if grad is not None]  # either may be absent
        for name, grad in grads:
            writable(name, grad)
        for _, grad in grads:
            libraries.assign(grad, np.zeros(tuple(grad.shape)))

    # --- the arrays --------------------------------------------------------------------------

    def _arrays_for(self, name: str, array: Any) -> tuple[tuple[str, str], dict[str, Any]]:
        """``array``'s (library, device) and the layer's per-channel arrays for it: its own,
        or new ones there (not yet the layer's: see ``_commit``)."""
        where = libraries.place(name, array)
        if self._pending is None:
            if where != self._place:
                raise InfiniError(
                    Status.BAD_PARAM,
                    f"{name} is a {where[0]} array on {where[1]}, but this layer's parameters "
                    f"and statistics are {self._place[0]} arrays on {self._place[1]}",
                )
            return where, {n: getattr(self, n) for n in PER_CHANNEL}
        assigned = [n for n in PER_CHANNEL if getattr(self, n) is not None]
        if assigned:  # the new arrays would replace them
            raise InfiniError(
                Status.BAD_PARAM,
                f"{', '.join(assigned)} assigned before the layer's arrays exist (the first "
                "forward makes them): give values with load_state_dict(), or make the arrays "
                "with like= and write into them",
            )
        dtype = operand(name, array).desc.dtype
        stats_dtype = "float64" if dtype == DataType.F64 else "float32"
        pending = self._pending
        return where, {
            n: libraries.new(pending[n], where, stats_dtype) if n in pending else None
            for n in PER_CHANNEL
        }

    def _commit(self, where: tuple[str, str], arrays: dict[str, Any]) -> None:
        """Make ``arrays`` (from ``_arrays_for``) the layer's own, kept at ``where``."""
        if self._pending is not None:
            self._place, self._pending = where, None
            for name, array in arrays.items():
                setattr(self, name, array)

    # --- passes ------------------------------------------------------------------------------

    @_public
    def forward(self, input: Any, z: Any = None) -> Any:
        """``bn(input)`` (``relu(bn(input) [+ z])`` when fused), as an array of its kind."""
        if (z is not None) != (self.fusion == "add_relu"):
            wants = "needs z" if z is None else "takes no z"
            raise InfiniError(Status.BAD_PARAM, f"fusion={self.fusion!r} {wants}")
        where, arrays = self._arrays_for("input", input)  # input: an array of the three's
        if self.DIMS is not None and len(input.shape) not in self.DIMS:  # torch's words
            expected = " or ".join(f"{d}D" for d in self.DIMS)
            raise InfiniError(
                Status.BAD_TENSOR_SHAPE,
                f"expected {expected} input (got {len(input.shape)}D input)",
            )
        weight, bias, *running = arrays.values()
        if (running[0] is None) != (running[1] is None):
            raise InfiniError(
                Status.BAD_PARAM,
                "running_mean and running_var must both be None or neither, as torch's",
            )
        if self.training or running[0] is None:  # torch's bn_training
            if self.eps <= 0:  # as torch's F.batch_norm with the batch's statistics
                raise InfiniError(
                    Status.BAD_PARAM,
                    "eps must be positive for the batch's statistics (training, or no running "
                    f"statistics), as torch's; got {self.eps}",
                )
            moving = self.training and self.track_running_stats
            counting = moving and self.num_batches_tracked is not None
            count = self.num_batches_tracked + 1 if counting else None
            momentum = self.momentum
            if momentum is None:  # the cumulative average (torch's factor 0 when not counting)
                momentum = 1.0 / count if counting else 0.0
            output, backward = self._batch_pass(
                input, z, weight, bias, *(running if moving else (None, None)), momentum
            )
            if counting:
                self.num_batches_tracked = count
        else:
            output, backward = self._eval_pass(input, z, weight, bias, *running)
        self._commit(where, arrays)
        self._backward = backward
        return output

    __call__ = forward

    def _batch_pass(
        self,
        input: Any,
        z: Any,
        weight: Any,
        bias: Any,
        running_mean: Any,
        running_var: Any,
        momentum: float,
    ) -> tuple[Any, Backward]:
        """Normalize with the batch's statistics, moving the running ones (when given) in
        place; the output and its backward."""
        outputs = batch_norm_forward_training(
            input, weight, bias, running_mean, running_var,
            momentum=momentum, eps=self.eps, fusion=self.fusion, z=z,
        )  # fmt: skip
        fused = dict(fusion=self.fusion, output=outputs[0], bias=bias) if self.fusion else {}
        return outputs[0], lambda grad_output: batch_norm_backward(
            input, grad_output, weight, None, None,
            eps=self.eps, mode="saved", saved_mean=outputs[1], saved_invstd=outputs[2],
            reserve=outputs.reserve, output_mask=wanted(weight, bias), **fused,
        )  # fmt: skip

    def _eval_pass(
        self, input: Any, z: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any
    ) -> tuple[Any, Backward]:
        """Normalize with the running statistics; the output and its (eval-rule) backward."""
        check_like_input("z", z, input)
        output = batch_norm_forward_inference(
            input, weight, bias, running_mean, running_var, eps=self.eps
        )
        fused = {}
        if self.fusion:
            output = add_relu(output, z)
            fused = dict(fusion=self.fusion, output=output, bias=bias)
        return output, lambda grad_output: batch_norm_backward(
            input, grad_output, weight, running_mean, running_var,
            eps=self.eps, mode="eval", output_mask=wanted(weight, bias), **fused,
        )  # fmt: skip

    @_public
    def backward(self, grad_output: Any) -> Any:
        """``grad_input`` of the last ``forward`` (``(grad_input, grad_z)`` for
        ``"add_relu"``); ``weight_grad``/``bias_grad`` accumulate (affine layers): one the
        caller set is added to in place, a writable float array of the layer's library and
        shape (else BAD_PARAM naming it, and nothing changes)."""
        if self._backward is None:
            raise InfiniError(
                Status.BAD_PARAM, "backward() needs a forward() first (one backward per forward)"
            )
        grad_input, grad_weight, grad_bias, *grad_z = self._backward(grad_output)
        sums = (("weight_grad", grad_weight), ("bias_grad", grad_bias))
        for name, grad in sums:
            if (total := getattr(self, name)) is not None and grad is not None:
                check_addend(name, total, grad)
        self._backward = None
        for name, grad in sums:
            total = getattr(self, name)
            if total is None:
                setattr(self, name, grad)
            elif grad is not None:
                libraries.add(total, grad)
        return (grad_input, grad_z[0]) if grad_z else grad_input

    # --- state dicts -------------------------------------------------------------------------

    @_public
    def state_dict(
        self,
        *,
        destination: MutableMapping | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> MutableMapping[str, Any]:
        """torch's names and order: ``weight``, ``bias``, ``running_mean``, ``running_var``,
        ``num_batches_tracked``, those the layer has (not None). The layer's own arrays (host
        float64 copies before they exist); ``num_batches_tracked`` a 0-d int64 array.

        As torch's ``Module.state_dict``: each name after ``prefix``, into ``destination``
        (returned; by default a new ``OrderedDict``), whose ``_metadata``, where it has one,
        gets torch's version 2 under ``prefix[:-1]``; ``keep_vars`` changes nothing (no
        autograd here)."""
        if not isinstance(prefix, str):
            raise InfiniError(Status.BAD_PARAM, f"prefix must be a str, got {prefix!r}")
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()  # type: ignore[attr-defined]
        elif not isinstance(destination, MutableMapping):
            raise InfiniError(
                Status.BAD_PARAM, f"destination must be a mutable mapping, got {destination!r}"
            )
        if hasattr(destination, "_metadata"):
            destination._metadata[prefix[:-1]] = {"version": 2}
        state = {n: v.copy() for n, v in self._pending.items()} if self._pending is not None else {
            name: getattr(self, name) for name in self._present()
        }  # fmt: skip
        if self.num_batches_tracked is not None:
            state["num_batches_tracked"] = libraries.new(
                np.array(self.num_batches_tracked), self._place or ("numpy", "cpu"), "int64"
            )
        destination.update((prefix + name, value) for name, value in state.items())
        return destination

    def reset_running_stats(self) -> None:
        """torch's: ``running_mean`` 0, ``running_var`` 1 and ``num_batches_tracked`` 0 (a
        tracking layer), in place."""
        self._reset("running_mean", "running_var", "num_batches_tracked")

    def reset_parameters(self) -> None:
        """torch's: the running statistics reset, and ``weight`` 1 and ``bias`` 0 (affine)."""
        self._reset("weight", "bias", "running_mean", "running_var", "num_batches_tracked")

    def _reset(self, *names: str) -> None:
        """Load the initial values (torch's) of those of ``names`` the layer has."""
        initial = {n: np.full(self.num_features, v) for n, v in self.defaults().items()}
        if self.track_running_stats:
            initial["num_batches_tracked"] = np.array(0)
        self.load_state_dict({n: initial[n] for n in names if n in initial}, strict=False)

    @_public
    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy a state (``state_dict()``'s names; arrays of any of the three libraries or
        anything NumPy reads, e.g. a torch module's state) into the layer's arrays, in place.
        ``strict``: missing or unexpected names raise; a missing ``num_batches_tracked`` keeps
        the count in a state of no version or one before 2 (torch's ``_metadata``), as torch's.
        Everything is checked first. Returns torch's ``(missing_keys, unexpected_keys)``."""
        if not isinstance(state, Mapping):
            raise InfiniError(
                Status.BAD_PARAM, f"state must be a mapping of names to arrays, got {state!r}"
            )
        expected = self._present()
        if self.num_batches_tracked is not None:
            expected.append("num_batches_tracked")
        kept = ("num_batches_tracked",) if state_version(state) < 2 else ()
        missing = [n for n in expected if n not in state and n not in kept]
        unexpected = [n for n in state if n not in expected]
        if strict and (missing or unexpected):
            raise InfiniError(
                Status.BAD_PARAM,
                f"state: missing {missing}, unexpected {unexpected} (expected {expected})",
            )
        values = {
            n: libraries.host(f"state[{n!r}]", state[n], integers=n == "num_batches_tracked")
            for n in expected
            if n in state
        }
        for name, value in values.items():
            shape = () if name == "num_batches_tracked" else (self.num_features,)
            if value.shape != shape:
                raise InfiniError(
                    Status.BAD_TENSOR_SHAPE,
                    f"state[{name!r}] has shape {value.shape}; expected {shape}",
                )
        count = values.pop("num_batches_tracked", None)
        if count is not None and not (
            0 <= count == np.floor(count) and (count.dtype == np.int64 or count < 2.0**63)
        ):
            raise InfiniError(
                Status.BAD_PARAM,
                f"state['num_batches_tracked'] must be a count below 2**63 (torch's int64), "
                f"got {count}",
            )
        if self._pending is None:  # as the array API refuses them, before anything is written
            for name in values:
                writable(name, getattr(self, name))
        for name, value in values.items():
            if self._pending is not None:
                self._pending[name] = value
            else:
                libraries.assign(getattr(self, name), value)
        if count is not None:
            self.num_batches_tracked = int(count)
        return IncompatibleKeys(missing, unexpected)


class BatchNorm1d(BatchNorm):
    """``BatchNorm`` for torch's ``BatchNorm1d`` input alone: ``(N, C)`` or ``(N, C, L)``
    (anything else: BAD_TENSOR_SHAPE, a ValueError with torch's message)."""

    DIMS = (2, 3)


class BatchNorm2d(BatchNorm):
    """``BatchNorm`` for torch's ``BatchNorm2d`` input alone: ``(N, C, H, W)``."""

    DIMS = (4,)


class BatchNorm3d(BatchNorm):
    """``BatchNorm`` for torch's ``BatchNorm3d`` input alone: ``(N, C, D, H, W)``."""

    DIMS = (5,)
