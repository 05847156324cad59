"""Parts given as values: ``policy=SnapKV(kernel_size=7), allocation=AdaKVAllocation(), switches=[ResidualCache()]``.

A part object is an instance of the registered class a flag names, so a composition given as values
stands for flat options (``method="snapkv", kernel_size=7, allocation="adakv", residual=True``) and is
built by the one door, ``CompressionConfig``: parts given as values and the same parts named by flags are
the same config, and run bit for bit the same. Flat names may be given beside them (the budget, the
window, the seed: ``compression_ratio=0.9``).
"""

from __future__ import annotations

from typing import Any, Mapping

from restkv.config.options import KINDS, ConfigError, Options, option_specs, registered

#: the arguments that take a part as a value: argument -> (the kind of part, the flat option naming it)
PART_ARGUMENTS = {"policy": ("method", "method"), "allocation": ("allocation", "allocation"),
                  "merge": ("merge", "merge"), "quantizer": ("quantization", "quant_method")}


def is_part(value: Any) -> bool:
    """Whether ``value`` is a part given as a value: an ``Options`` instance or class (not a name)."""
    return isinstance(value, Options) or (isinstance(value, type) and issubclass(value, Options))


def has_parts(options: Mapping[str, Any]) -> bool:
    """Whether ``options`` give any part as a value (``policy=``, ``switches=``, a part for ``allocation=``...)."""
    return any(name in options for name in ("policy", "quantizer", "switches")) or any(
        is_part(options.get(name)) for name in PART_ARGUMENTS)


def flat_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Options]]]:
    """``options`` with each part given as a value replaced by the flat options it stands for (its name
    under its kind's flag, its options that differ from their defaults), and the parts as given, by the
    argument that gave them, to check against the composed config (``check_composed``)."""
    flat = {name: value for name, value in options.items()
            if name != "switches" and not (name in PART_ARGUMENTS and is_part(value))}
    if "policy" in flat:  # a name is the flat --method
        raise ConfigError(f"policy= takes a method part (e.g. SnapKV()); got {flat['policy']!r} (for a name, use "
                          f"method={flat['policy']!r})")
    if "quantizer" in flat:
        raise ConfigError(f"quantizer= takes a quantisation part (e.g. KIVI()); got {flat['quantizer']!r} (for a "
                          f"name, use quant_method={flat['quantizer']!r})")
    given: list[tuple[str, Options]] = []
    for argument, (kind, flag) in PART_ARGUMENTS.items():
        if is_part(options.get(argument)):
            part = _instance(options[argument], kind, f"{argument}=")
            _name_once(flat, flag, part.name, argument)
            given.append((argument, part))
    switches = options.get("switches", ())
    if isinstance(switches, (str, bytes, Options, type)) or not hasattr(switches, "__iter__"):
        raise ConfigError(f"switches= takes a list of switch parts (e.g. [ResidualCache()]); got {switches!r}")
    for item in switches:
        part = _instance(item, "switch", "switches=")
        if flat.get(part.name) is True and any(type(other) is type(part) for _, other in given):
            raise ConfigError(f"switches= gives the {part.name} switch twice")
        if flat.get(part.name) is False:
            raise ConfigError(f"switches= turns --{part.name} on and {part.name}=False turns it off; give one")
        flat[part.name] = True
        given.append(("switches", part))
    for argument, part in given:
        for name, value in part.options().items():
            if value == option_specs(type(part))[name].default:
                continue
            if name in flat and flat[name] != value:
                raise ConfigError(f"{name} is {value!r} in {type(part).__name__} ({argument}) and {flat[name]!r} "
                                  f"elsewhere: an option is one flag (--{name}), shared by every part that declares "
                                  "it; give it once")
            flat[name] = value
    return flat, given


def check_composed(config, given: list[tuple[str, Options]]) -> None:
    """Refuse a composition whose parts are not the parts given: two parts given different values of an option
    they share (one flag, ``--n_sink``), so a config given as values never runs other options than it names."""
    composed = {type(part): part for part in config.parts}
    for argument, part in given:
        built = composed[type(part)]  # every part given is composed (a conflicting name was refused before)
        expected = part.for_run(config.run) if hasattr(part, "for_run") else part
        if built != expected:
            differ = [name for name in option_specs(type(part)) if getattr(built, name) != getattr(expected, name)]
            runs, given_values = ", ".join(f"{n}={getattr(built, n)!r}" for n in differ), ", ".join(
                f"{n}={getattr(expected, n)!r}" for n in differ)
            raise ConfigError(f"{type(part).__name__} ({argument}) runs with {runs}, not the {given_values} it was "
                              "given: another part sets the same flag; give every part that declares it the same value")


def _instance(value: Any, kind: str, argument: str) -> Options:
    """``value`` as a registered part of ``kind`` (a class stands for its defaults)."""
    cls = value if isinstance(value, type) else type(value)
    if cls not in registered(kind):
        owner = next((other for other in KINDS if cls in registered(other)), None)
        what = f"a registered {owner}" if owner else "not a registered part"
        raise ConfigError(f"{argument} takes a {kind} (one of {', '.join(c.__name__ for c in registered(kind))}); "
                          f"{cls.__name__} is {what}")
    return value() if isinstance(value, type) else value


def _name_once(flat: dict[str, Any], flag: str, name: str, argument: str) -> None:
    """Set the flat ``flag`` to the part's ``name``, refusing another name given for it."""
    if flat.get(flag) not in (None, name):
        raise ConfigError(f"{argument}= gives the {flag} {name!r} and {flag}={flat[flag]!r} another; give one")
    flat[flag] = name
