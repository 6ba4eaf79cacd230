"""``batch_norm_backward``: the array API's backward pass."""

from typing import Any, ClassVar

from ..enums import Status
from ..errors import InfiniError, respelled
from ..ops.batch_norm_backward import BatchNormBackwardDescriptor, parse_fusion, parse_mode
from ..ops.validation import check_eps, check_flag, check_output_mask
from ..problems import BackwardTensors, Fusion, Mode
from ..runtime import Handle
from ..tensor import TensorDesc
from .call import Built, run
from .outputs import absent_parameter, packed_like, reserve_bytes

GRADIENTS = ("grad_input", "grad_weight", "grad_bias", "grad_z")
_STATISTICS = ("running_mean", "running_var", "saved_mean", "saved_invstd")

ALL_GRADIENTS = (True, True, True)  # the default output_mask
_ALL_TYPES = (bool, bool, bool)


class Backward:
    """The backward pass: reads input, grad_output, weight, statistics (running or saved),
    a fused forward's output and bias, a reserve; writes the ``out=`` arrays given."""

    name = "backward"
    names = (
        "input",
        "grad_output",
        "weight",
        *_STATISTICS,
        "output",
        "bias",
        "reserve",
        *GRADIENTS,
    )
    out_names, out_optional = GRADIENTS, 1
    written = frozenset(GRADIENTS)
    writes = tuple(map(written.__contains__, names))
    spelling: ClassVar[dict[str, str]] = {g: f"out[{i}]" for i, g in enumerate(GRADIENTS)}

    def options(self, raw: tuple, arrays: dict[str, Any]) -> tuple:
        mode, eps, fusion, mask, persistent, check_overflow, _ = raw
        return (
            statistics(mode, *(arrays[n] for n in _STATISTICS)),
            check_eps(eps),
            parse_fusion(fusion),
            check_output_mask(mask),
            check_flag("persistent", persistent),
            check_flag("check_overflow", check_overflow) is True,
        )

    def build(self, handle: Handle, descs: dict[str, TensorDesc | None], options: tuple) -> Built:
        mode, eps, fusion, mask, persistent, check_overflow = options
        saved = descs["saved_mean"] is not None
        x, w = descs["input"], descs["weight"]
        constants = {}
        if w is None:  # affine=False: weight 1, and no grad_weight
            w = absent_parameter(x, descs, ("running_mean", "saved_mean", "bias"))
            constants["weight"] = (1.0, w)
            mask = (mask[0], False, mask[2])
        bias = descs["bias"]
        if bias is None and fusion != Fusion.BN:  # a fused forward's absent bias was 0
            bias = TensorDesc.contiguous(w.dtype, w.shape)
            constants["bias"] = (0.0, bias)
        per_channel = TensorDesc.contiguous(w.dtype, w.shape)
        wants_z = fusion == Fusion.BN_ADD_RELU
        given = {g: descs.get(g) for g in GRADIENTS}
        if given["grad_z"] is not None and not wants_z:
            raise InfiniError(
                Status.BAD_PARAM, "grad_z is given, but only fusion='add_relu' has one"
            )
        tensors = BackwardTensors(
            given["grad_input"] or packed_like(x),
            given["grad_weight"] or per_channel,
            given["grad_bias"] or per_channel,
            x,
            descs["grad_output"],
            w,
            descs["saved_mean" if saved else "running_mean"],
            descs["saved_invstd" if saved else "running_var"],
            descs["output"],
            bias,
            (given["grad_z"] or packed_like(x)) if wants_z else None,
        )
        try:
            descriptor = BatchNormBackwardDescriptor(
                handle,
                *tensors[:8],
                output_desc=tensors.output,
                bias_desc=tensors.bias,
                grad_z_desc=tensors.grad_z,
                eps=eps,
                mode=mode,
                fusion=fusion,
                output_mask=mask,
                persistent=persistent,
                reserve=descs["reserve"] is not None,
                check_overflow=check_overflow,
            )
        except InfiniError as exc:  # the saved statistics as the caller named them
            spelling = {"running_mean_desc": "saved_mean", "running_var_desc": "saved_invstd"}
            raise respelled(exc, spelling if saved else {}) from None
        wanted = (*descriptor.attributes.output_mask, wants_z)
        outputs = {
            g: getattr(tensors, g)
            for g, needed in zip(GRADIENTS, wanted, strict=True)
            if needed and given[g] is None
        }
        pointers = {g: g if m else None for g, m in zip(GRADIENTS, wanted, strict=True)}
        if saved:
            pointers |= {"running_mean": "saved_mean", "running_var": "saved_invstd"}
        returns = tuple(
            g if m and not (g == "grad_weight" and descs["weight"] is None) else None
            for g, m in zip(GRADIENTS, wanted, strict=True)
        )
        return Built(
            descriptor,
            pointers,
            outputs,
            returns[:4] if wants_z else returns[:3],
            constants,
            reserve_size=reserve_bytes(descs["reserve"], descriptor.reserve_size) or 0,
        )

    result = None  # the tuple of the gradients


BACKWARD = Backward()


def statistics(
    mode: str, running_mean: Any, running_var: Any, saved_mean: Any, saved_invstd: Any
) -> Mode:
    """The parsed mode, checking how the statistics were given: ``saved_mean``/``saved_invstd``
    (both, with ``mode="saved"``, instead of ``running_*``) make it SAVED_INVSTD."""
    parsed = parse_mode(mode)
    if saved_mean is None and saved_invstd is None:
        return parsed
    if parsed != Mode.SAVED:
        raise InfiniError(
            Status.BAD_PARAM, f"saved_mean/saved_invstd need mode='saved', got mode={mode!r}"
        )
    if running_mean is not None or running_var is not None:
        raise InfiniError(
            Status.BAD_PARAM, "give running_mean/running_var or saved_mean/saved_invstd, not both"
        )
    if saved_mean is None or saved_invstd is None:
        missing = "saved_mean" if saved_mean is None else "saved_invstd"
        raise InfiniError(
            Status.NULL_POINTER, f"{missing} is None but the other saved statistic is given"
        )
    return Mode.SAVED_INVSTD


def batch_norm_backward(
    input: Any,
    grad_output: Any,
    weight: Any,
    running_mean: Any,
    running_var: Any,
    *,
    eps: float = 1e-5,
    mode: str = "train",
    saved_mean: Any = None,
    saved_invstd: Any = None,
    stream: Any = None,
    output_mask: tuple[bool, bool, bool] = ALL_GRADIENTS,
    fusion: str | None = None,
    output: Any = None,
    bias: Any = None,
    reserve: Any = None,
    persistent: bool | None = None,
    check_overflow: bool = False,
    out: tuple[Any, ...] | None = None,
) -> tuple[Any, ...]:
    """``(grad_input, grad_weight, grad_bias)`` of batch norm, as arrays of ``input``'s kind.

    ``mode`` picks the statistics: ``"train"`` recomputes the batch mean and biased
    variance from ``input`` (``running_*`` are checked, not read, and may be None);
    ``"saved"`` reads ``running_mean``/``running_var`` as the batch mean and biased variance,
    or takes ``saved_mean``/``saved_invstd`` exactly as a forward pass saved them;
    ``"eval"`` treats ``running_*`` as fixed statistics. ``weight=None`` is a weight of ones
    (``affine=False``); its gradient is then None.

    ``output_mask`` asks only for some gradients: the others come back as None and are never
    written. ``out=(grad_input, grad_weight, grad_bias[, grad_z])`` gives preallocated
    outputs (None entries are allocated), checked like every array written in place.
    ``fusion`` (``"relu"``, ``"add_relu"``) is the backward of a fused forward: it needs that
    forward's ``output`` and ``bias`` and takes its ``reserve`` (without one it runs on the
    CuPy engine on NVIDIA), and with ``"add_relu"`` also returns ``grad_z``, the residual's
    gradient, as a fourth result. ``persistent=False`` forces cuDNN's SPATIAL mode where
    SPATIAL_PERSISTENT would be used (channels-last). ``check_overflow=True`` is a debug aid
    that synchronizes: after a cuDNN SPATIAL_PERSISTENT pass it waits
    (``cudnnQueryRuntimeError``) and warns with a ``RuntimeWarning`` if cuDNN reports a
    numerical overflow, as CuPy 13's ``debug`` did.
    """
    arrays = (
        input,
        grad_output,
        weight,
        running_mean,
        running_var,
        saved_mean,
        saved_invstd,
        output,
        bias,
        reserve,
    )
    raw = raw_options(mode, eps, fusion, output_mask, persistent, check_overflow)
    return run(BACKWARD, arrays, raw, stream, out)


def raw_options(
    mode: Any, eps: Any, fusion: Any, output_mask: Any, persistent: Any, check_overflow: Any
) -> tuple:
    """A backward's options as ``call.run`` takes them (``Backward.options`` checks them): an
    output mask given as a list as its tuple, keyed with its items' types (``options_key``)."""
    if output_mask is ALL_GRADIENTS:  # the default: its types known
        return mode, eps, fusion, output_mask, persistent, check_overflow, _ALL_TYPES
    mask_types = None
    if type(output_mask) in (tuple, list):
        output_mask = tuple(output_mask)
        mask_types = tuple(map(type, output_mask))
    return mode, eps, fusion, output_mask, persistent, check_overflow, mask_types
