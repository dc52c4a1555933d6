"""Method registry: adding a method is one new module and one line here."""

from __future__ import annotations

from mergekit_loco.methods.base import MergeMethod
from mergekit_loco.methods.breadcrumbs import Breadcrumbs
from mergekit_loco.methods.dare import Dare
from mergekit_loco.methods.iso import IsoC
from mergekit_loco.methods.iso_cts import IsoCts
from mergekit_loco.methods.mean import Mean
from mergekit_loco.methods.ta import TaskArithmetic
from mergekit_loco.methods.ties import Ties
from mergekit_loco.methods.tsv import Tsv

METHODS: dict[str, type[MergeMethod]] = {
    cls.name: cls for cls in (Mean, TaskArithmetic, Ties, Dare, Breadcrumbs, Tsv, IsoC, IsoCts)
}


def list_methods() -> list[str]:
    return list(METHODS)


def get_method(name: str, **params) -> MergeMethod:
    """``get_method("ties", density=0.3)``: the method named ``name`` with its parameters.

    Unknown names and parameters the method does not take raise ``ValueError`` saying what is
    accepted; out-of-range values raise ``ValueError`` from the method itself.
    """
    if name not in METHODS:
        raise ValueError(f"unknown merge method {name!r}; choose one of {', '.join(METHODS)}")
    cls = METHODS[name]
    accepted = cls.parameter_names()
    unknown = [key for key in params if key not in accepted]
    if unknown:
        takes = ", ".join(accepted) if accepted else "no parameters"
        raise ValueError(f"method {name!r} does not take {unknown[0]!r} (it takes: {takes})")
    return cls(**params)
