//! Where a component's contract types differ from the host's: the record (enum, variant, flags) and the field, named from the host's own WIT.
//!
//! wasmtime refuses a component whose types differ from the host's bindings, but its message
//! names the function and the field only. When that happens, this walks the interfaces the
//! component imports from `plughost:plugin`, compares each named type with the one in the
//! host's WIT, and names the first difference.

use wasmtime::Engine;
use wasmtime::component::types::{self as wt, ComponentItem};
use wit_parser::{Resolve, Type, TypeDefKind};

use super::contract::ContractVersion;

/// The first named type of `component` whose shape differs from the host's WIT of `version`,
/// the version the component names, as a sentence.
pub(crate) fn first_difference(
    engine: &Engine,
    component: &wt::Component,
    version: ContractVersion,
) -> Option<String> {
    let mut resolve = Resolve::default();
    let package = resolve.push_str("plugin.wit", version.wit()).ok()?;
    let prefix = "plughost:plugin/";
    for (name, import) in component.imports(engine) {
        let Some(interface) = name
            .strip_prefix(prefix)
            .map(|rest| rest.split('@').next().unwrap_or(rest))
        else {
            continue;
        };
        let ComponentItem::ComponentInstance(instance) = import.ty else {
            continue;
        };
        let Some(&host_interface) = resolve.packages[package].interfaces.get(interface) else {
            continue;
        };
        for (type_name, export) in instance.exports(engine) {
            let ComponentItem::Type(theirs) = export.ty else {
                continue;
            };
            let Some(&ours) = resolve.interfaces[host_interface].types.get(type_name) else {
                continue;
            };
            let ours = &resolve.types[ours].kind;
            if let Some(difference) = compare(&resolve, ours, &theirs) {
                return Some(format!(
                    "{} `{type_name}` of {prefix}{interface}@{version} differs: {difference}",
                    kind_name(ours)
                ));
            }
        }
    }
    None
}

fn kind_name(kind: &TypeDefKind) -> &'static str {
    match kind {
        TypeDefKind::Record(_) => "record",
        TypeDefKind::Enum(_) => "enum",
        TypeDefKind::Variant(_) => "variant",
        TypeDefKind::Flags(_) => "flags",
        _ => "type",
    }
}

/// How `theirs` differs from the host's `ours`, by member names and their types' shapes.
fn compare(resolve: &Resolve, ours: &TypeDefKind, theirs: &wt::Type) -> Option<String> {
    match (ours, theirs) {
        (TypeDefKind::Record(record), wt::Type::Record(other)) => {
            let ours: Vec<(&str, String)> = record
                .fields
                .iter()
                .map(|f| (f.name.as_str(), wit_shape(resolve, &f.ty)))
                .collect();
            let theirs: Vec<(&str, String)> = other
                .fields()
                .map(|f| (f.name, component_shape(&f.ty)))
                .collect();
            members("field", &ours, &theirs)
        }
        (TypeDefKind::Variant(variant), wt::Type::Variant(other)) => {
            let ours: Vec<(&str, String)> = variant
                .cases
                .iter()
                .map(|c| {
                    (
                        c.name.as_str(),
                        optional(c.ty.as_ref().map(|t| wit_shape(resolve, t))),
                    )
                })
                .collect();
            let theirs: Vec<(&str, String)> = other
                .cases()
                .map(|c| (c.name, optional(c.ty.as_ref().map(component_shape))))
                .collect();
            members("case", &ours, &theirs)
        }
        (TypeDefKind::Enum(e), wt::Type::Enum(other)) => {
            let ours: Vec<(&str, String)> = e
                .cases
                .iter()
                .map(|c| (c.name.as_str(), String::new()))
                .collect();
            let theirs: Vec<(&str, String)> = other.names().map(|n| (n, String::new())).collect();
            members("case", &ours, &theirs)
        }
        (TypeDefKind::Flags(f), wt::Type::Flags(other)) => {
            let ours: Vec<(&str, String)> = f
                .flags
                .iter()
                .map(|c| (c.name.as_str(), String::new()))
                .collect();
            let theirs: Vec<(&str, String)> = other.names().map(|n| (n, String::new())).collect();
            members("flag", &ours, &theirs)
        }
        (
            TypeDefKind::Record(_)
            | TypeDefKind::Variant(_)
            | TypeDefKind::Enum(_)
            | TypeDefKind::Flags(_),
            other,
        ) => Some(format!(
            "the component declares it as {}",
            component_shape(other)
        )),
        _ => None,
    }
}

fn optional(shape: Option<String>) -> String {
    shape.unwrap_or_default()
}

/// The first member (in declaration order) that is missing, extra, renamed or retyped.
fn members(what: &str, ours: &[(&str, String)], theirs: &[(&str, String)]) -> Option<String> {
    for (i, (name, shape)) in ours.iter().enumerate() {
        match theirs.iter().position(|(n, _)| n == name) {
            None => {
                return Some(match theirs.get(i) {
                    Some((other, _)) if !ours.iter().any(|(n, _)| n == other) => format!(
                        "{what} {} is `{name}` in this host and `{other}` in the component",
                        i + 1
                    ),
                    _ => format!("the component lacks {what} `{name}`"),
                });
            }
            Some(j) if theirs[j].1 != *shape => {
                return Some(format!(
                    "{what} `{name}` is {shape} in this host and {} in the component",
                    theirs[j].1
                ));
            }
            Some(j) if j != i => {
                return Some(format!(
                    "{what} `{name}` is number {} in this host and {} in the component",
                    i + 1,
                    j + 1
                ));
            }
            Some(_) => {}
        }
    }
    theirs
        .iter()
        .find(|(n, _)| !ours.iter().any(|(o, _)| o == n))
        .map(|(name, _)| {
            format!("the component has {what} `{name}`, which this host does not know")
        })
}

/// A type's shape in WIT words, deep enough to tell two member types apart.
fn wit_shape(resolve: &Resolve, ty: &Type) -> String {
    match ty {
        Type::Bool => "bool".into(),
        Type::U8 => "u8".into(),
        Type::U16 => "u16".into(),
        Type::U32 => "u32".into(),
        Type::U64 => "u64".into(),
        Type::S8 => "s8".into(),
        Type::S16 => "s16".into(),
        Type::S32 => "s32".into(),
        Type::S64 => "s64".into(),
        Type::F32 => "f32".into(),
        Type::F64 => "f64".into(),
        Type::Char => "char".into(),
        Type::String => "string".into(),
        Type::ErrorContext => "error-context".into(),
        Type::Id(id) => match &resolve.types[*id].kind {
            TypeDefKind::Type(inner) => wit_shape(resolve, inner),
            TypeDefKind::List(inner) => format!("list<{}>", wit_shape(resolve, inner)),
            TypeDefKind::Option(inner) => format!("option<{}>", wit_shape(resolve, inner)),
            TypeDefKind::Record(_) => "a record".into(),
            TypeDefKind::Variant(_) => "a variant".into(),
            TypeDefKind::Enum(_) => "an enum".into(),
            TypeDefKind::Flags(_) => "flags".into(),
            TypeDefKind::Tuple(_) => "a tuple".into(),
            TypeDefKind::Result(_) => "a result".into(),
            TypeDefKind::Handle(_) | TypeDefKind::Resource => "a resource".into(),
            _ => "another type".into(),
        },
    }
}

/// A type's shape in WIT words, from the component's side.
fn component_shape(ty: &wt::Type) -> String {
    match ty {
        wt::Type::Bool => "bool".into(),
        wt::Type::U8 => "u8".into(),
        wt::Type::U16 => "u16".into(),
        wt::Type::U32 => "u32".into(),
        wt::Type::U64 => "u64".into(),
        wt::Type::S8 => "s8".into(),
        wt::Type::S16 => "s16".into(),
        wt::Type::S32 => "s32".into(),
        wt::Type::S64 => "s64".into(),
        wt::Type::Float32 => "f32".into(),
        wt::Type::Float64 => "f64".into(),
        wt::Type::Char => "char".into(),
        wt::Type::String => "string".into(),
        wt::Type::ErrorContext => "error-context".into(),
        wt::Type::List(inner) => format!("list<{}>", component_shape(&inner.ty())),
        wt::Type::Option(inner) => format!("option<{}>", component_shape(&inner.ty())),
        wt::Type::Record(_) => "a record".into(),
        wt::Type::Variant(_) => "a variant".into(),
        wt::Type::Enum(_) => "an enum".into(),
        wt::Type::Flags(_) => "flags".into(),
        wt::Type::Tuple(_) => "a tuple".into(),
        wt::Type::Result(_) => "a result".into(),
        wt::Type::Own(_) | wt::Type::Borrow(_) => "a resource".into(),
        _ => "another type".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(list: &[(&'a str, &str)]) -> Vec<(&'a str, String)> {
        list.iter().map(|(n, t)| (*n, t.to_string())).collect()
    }

    #[test]
    fn names_the_first_member_that_differs() {
        let host = fields(&[("a", "u32"), ("b", "f32"), ("c", "string")]);
        let cases = [
            (vec![("a", "u32"), ("b", "f32"), ("c", "string")], None),
            (
                vec![("a", "u32"), ("x", "f32"), ("c", "string")],
                Some("field 2 is `b` in this host and `x` in the component"),
            ),
            (
                vec![("a", "u32"), ("c", "string")],
                Some("the component lacks field `b`"),
            ),
            (
                vec![("a", "u32"), ("b", "u32"), ("c", "string")],
                Some("field `b` is f32 in this host and u32 in the component"),
            ),
            (
                vec![("b", "f32"), ("a", "u32"), ("c", "string")],
                Some("field `a` is number 1 in this host and 2 in the component"),
            ),
            (
                vec![("a", "u32"), ("b", "f32"), ("c", "string"), ("d", "bool")],
                Some("the component has field `d`, which this host does not know"),
            ),
        ];
        for (theirs, expected) in cases {
            let theirs = fields(&theirs);
            assert_eq!(
                members("field", &host, &theirs).as_deref(),
                expected,
                "{theirs:?}"
            );
        }
    }

    #[test]
    fn the_host_wit_parses() {
        for version in ContractVersion::ALL {
            let mut resolve = Resolve::default();
            let package = resolve
                .push_str("plugin.wit", version.wit())
                .expect("the host's WIT");
            let sampling = resolve.packages[package].interfaces["sampling"];
            assert!(
                resolve.interfaces[sampling]
                    .types
                    .contains_key("sampling-params"),
                "{version}"
            );
        }
    }
}
