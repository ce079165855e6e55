//! Python-compatible text of template values: `json.dumps` for HF's `tojson`, `repr` for printing.
//!
//! Hugging Face renders chat templates with Python's Jinja2, so what a template prints must be
//! what Python would print: `None`/`True`, `{'a': 1}`, `1e-05`, and `tojson` as `json.dumps`
//! with `ensure_ascii=False` (no HTML escaping, `", "` and `": "` separators).

use std::fmt::Write;

use minijinja::Value;
use minijinja::value::ValueKind;

/// The options of HF's `tojson` filter, which forwards them to `json.dumps`.
#[derive(Debug, Clone)]
pub struct JsonOptions {
    pub ensure_ascii: bool,
    /// `None` is one line; `Some("")` puts items on their own lines without indenting.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for JsonOptions {
    fn default() -> Self {
        JsonOptions {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// Why a value cannot be written as JSON.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct JsonError(String);

/// `json.dumps(value, ...)` with the given options.
pub fn to_json(value: &Value, options: &JsonOptions) -> Result<String, JsonError> {
    let mut out = String::new();
    write_json(&mut out, value, options, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    value: &Value,
    options: &JsonOptions,
    depth: usize,
) -> Result<(), JsonError> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, true),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or(""), options),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = iter_values(value)?;
            write_container(out, '[', ']', items.len(), options, depth, |out, i| {
                write_json(out, &items[i], options, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut pairs = map_pairs(value)?;
            if options.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', pairs.len(), options, depth, |out, i| {
                let (key, item) = &pairs[i];
                write_json_string(out, key, options);
                out.push_str(&options.key_separator);
                write_json(out, item, options, depth + 1)
            })?;
        }
        _ => {
            return Err(JsonError(format!(
                "Object of type {} is not JSON serializable",
                value.kind()
            )));
        }
    }
    Ok(())
}

fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    options: &JsonOptions,
    depth: usize,
    mut write_item: impl FnMut(&mut String, usize) -> Result<(), JsonError>,
) -> Result<(), JsonError> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&options.item_separator);
        }
        if let Some(indent) = &options.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        write_item(out, i)?;
    }
    if let Some(indent) = &options.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

fn write_json_string(out: &mut String, s: &str, options: &JsonOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (options.ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Integers as digits; floats as Python's `repr` (`json.dumps` writes `NaN`, `Infinity`).
fn write_number(out: &mut String, value: &Value, json: bool) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(f) => out.push_str(&float_repr(f, json)),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional for exponents
/// -4..16, else scientific with a signed two-digit exponent.
pub fn float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if f.is_infinite() {
        let name = if json { "Infinity" } else { "inf" };
        return if f > 0.0 {
            name.to_string()
        } else {
            format!("-{name}")
        };
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e2", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let int_len = exponent as usize + 1;
            if digits.len() > int_len {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            } else {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exponent - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "e{exp_sign}{:02}", exponent.unsigned_abs());
    }
    out
}

/// Python's `str(value)` as Jinja2 prints it: strings as they are, containers as `repr`.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or("").to_string(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)`.
pub fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                write_number(out, value, false);
            }
        }
        ValueKind::String => write_repr_string(out, value.as_str().unwrap_or("")),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() {
                ('(', ')')
            } else {
                ('[', ']')
            };
            out.push(open);
            let items = iter_values(value).unwrap_or_default();
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            if value.is_tuple() && items.len() == 1 {
                out.push(',');
            }
            out.push(close);
        }
        ValueKind::Map => {
            out.push('{');
            for (i, (key, item)) in map_pairs(value).unwrap_or_default().iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr_string(out, key);
                out.push_str(": ");
                write_repr(out, item);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

fn write_repr_string(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn iter_values(value: &Value) -> Result<Vec<Value>, JsonError> {
    value
        .try_iter()
        .map(|iter| iter.collect())
        .map_err(|e| JsonError(e.to_string()))
}

/// A map's entries in its own order; keys that are not strings are written as Python would.
fn map_pairs(value: &Value) -> Result<Vec<(String, Value)>, JsonError> {
    let keys = iter_values(value)?;
    keys.into_iter()
        .map(|key| {
            let item = value.get_item(&key).map_err(|e| JsonError(e.to_string()))?;
            let key = match key.kind() {
                ValueKind::String => key.as_str().unwrap_or("").to_string(),
                ValueKind::None => "null".to_string(),
                ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
                _ => py_str(&key),
            };
            Ok((key, item))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (123.5, "123.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1.2345e20, "1.2345e+20"),
            (123456789012345.0, "123456789012345.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
        ];
        for (f, expected) in cases {
            assert_eq!(float_repr(f, false), expected, "{f}");
        }
        assert_eq!(float_repr(f64::NAN, true), "NaN");
        assert_eq!(float_repr(f64::NEG_INFINITY, true), "-Infinity");
    }

    fn value(json: &str) -> Value {
        serde_json::from_str(json).expect("test JSON")
    }

    #[test]
    fn json_matches_python_json_dumps() {
        let indented = JsonOptions {
            indent: Some("  ".to_string()),
            item_separator: ",".to_string(),
            ..JsonOptions::default()
        };
        let ascii = JsonOptions {
            ensure_ascii: true,
            ..JsonOptions::default()
        };
        let sorted = JsonOptions {
            sort_keys: true,
            ..JsonOptions::default()
        };
        let cases = [
            (
                r#"{"b": [1, 2.5, null, true], "a": "<tag> & 'q' \"d\""}"#,
                JsonOptions::default(),
                r#"{"b": [1, 2.5, null, true], "a": "<tag> & 'q' \"d\""}"#,
            ),
            (
                r#""héllo 世界 😀\n\u0001""#,
                JsonOptions::default(),
                "\"héllo 世界 😀\\n\\u0001\"",
            ),
            (r#""é😀""#, ascii, r#""\u00e9\ud83d\ude00""#),
            (r#"{"z": 1, "a": {}}"#, sorted, r#"{"a": {}, "z": 1}"#),
            (
                r#"{"a": [1, {"b": []}], "c": {}}"#,
                indented,
                "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ],\n  \"c\": {}\n}",
            ),
        ];
        for (input, options, expected) in cases {
            assert_eq!(
                to_json(&value(input), &options).expect(input),
                expected,
                "{input}"
            );
        }
    }

    #[test]
    fn printed_values_look_like_python() {
        let cases = [
            ("null", "None"),
            ("true", "True"),
            (r#""plain""#, "plain"),
            (
                r#"["a", "it's", 1, 1.0, null]"#,
                r#"['a', "it's", 1, 1.0, None]"#,
            ),
            (
                r#"{"k": false, "n": "x\ny"}"#,
                r#"{'k': False, 'n': 'x\ny'}"#,
            ),
        ];
        for (input, expected) in cases {
            assert_eq!(py_str(&value(input)), expected, "{input}");
        }
    }
}
