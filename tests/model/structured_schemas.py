"""A hypothesis strategy of JSON schemas for the structured-output property tests.

Objects (required subsets, closed), arrays, enums, nested $defs with $ref, anyOf, anchored
string patterns, bounded integers, booleans and null (no `number`: a JSON number's fraction has
no length limit, and SmolLM2 can write digits until max_tokens, as a full run showed); bounded in size (strings of at
most 12 characters, arrays of at most 3 items, nesting depth 3) so that a complete answer fits
in a few hundred tokens and "every output validates" can be asked of every output.
"""

from __future__ import annotations

from hypothesis import strategies as st

PROPERTY_NAMES = ("id", "name", "kind", "value", "tags", "count", "ok", "note", "items", "score")
PATTERNS = ("^[a-z]{2,6}$", "^[A-Z][a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^#[0-9a-f]{6}$")


def _integer():
    return st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
                     st.integers(-1000, 1000), st.integers(0, 5000))


def _string():
    return st.builds(lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra},
                     st.integers(0, 3), st.integers(1, 9))


leaves = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    _integer(),
    _string(),
    st.sampled_from(PATTERNS).map(lambda pattern: {"type": "string", "pattern": pattern}),
    st.lists(st.one_of(st.sampled_from(["red", "green", "blue", "a b", "é"]), st.integers(-5, 5)),
             min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
)


def _object(children):
    return st.dictionaries(st.sampled_from(PROPERTY_NAMES), children, min_size=1, max_size=3).flatmap(
        lambda properties: st.lists(st.sampled_from(sorted(properties)), unique=True).map(
            lambda required: {"type": "object", "properties": properties, "required": required,
                              "additionalProperties": False}))


def _array(children):
    return st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low,
                                                "maxItems": low + extra},
                     children, st.integers(0, 1), st.integers(1, 2))


def _extend(children):
    return st.one_of(_object(children), _array(children),
                     st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}))


values = st.recursive(leaves, _extend, max_leaves=6)


def _with_definitions(definition, body):
    """A top-level object whose property `ref` points into $defs."""
    properties = dict(body["properties"], ref={"$ref": "#/$defs/shared"})
    return {"$defs": {"shared": definition}, "type": "object", "properties": properties,
            "required": sorted(set(body["required"]) | {"ref"}), "additionalProperties": False}


schemas = st.one_of(
    _object(values),
    st.builds(_with_definitions, values, _object(values)),
)


def instances(schema, root=None):
    """Valid instances of a schema of `schemas`. Leaves come from hypothesis-jsonschema's
    from_schema; objects and arrays are assembled here, because hypothesis-jsonschema 0.23.1
    draws objects through a hypothesis internal (`many.more()`) that current hypothesis removed."""
    from hypothesis_jsonschema import from_schema

    root = schema if root is None else root
    if "$ref" in schema:
        return instances(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "anyOf" in schema:
        return st.one_of(*(instances(option, root) for option in schema["anyOf"]))
    if schema.get("type") == "object":
        properties = schema["properties"]
        optional = sorted(set(properties) - set(schema["required"]))
        present_optional = st.lists(st.sampled_from(optional), unique=True) if optional else st.just([])
        # Our grammars write properties in the schema's order (documented); so do these instances.
        return present_optional.flatmap(lambda present: st.fixed_dictionaries(
            {name: instances(properties[name], root) for name in properties
             if name in schema["required"] or name in present})).map(
            lambda value: {name: value[name] for name in properties if name in value})
    if schema.get("type") == "array":
        return st.lists(instances(schema["items"], root), min_size=schema["minItems"], max_size=schema["maxItems"])
    return from_schema(schema).filter(_within_llguidance_forms)


def _within_llguidance_forms(value) -> bool:
    """Two forms JSON allows that llguidance's grammars refuse (documented limitations, not
    tested here): code points of the planes Unicode has not assigned (3 to 13, e.g. U+A3787) in
    strings, and exponent notation (6.2e-50) for a number with minimum / maximum."""
    if isinstance(value, str):
        return all(ord(character) < 0x30000 for character in value)
    if isinstance(value, float):
        return "e" not in repr(value)
    return True
