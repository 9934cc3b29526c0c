//! Tables of a config file (or of a `--vm` spec) deserialized by serde, with each error
//! turned into a [`ConfigError`] that names the key it is about and keeps its place in
//! the text.
//!
//! Every table is first parsed into toml's spanned [`DeTable`]: the spans of its keys
//! and values say which key an error of serde's (an unknown field) or of a value's
//! parser ([`super::values::de`]) is about, and on which line.

use std::ops::Range;

use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::ConfigError;

/// A configuration error and the span of the text it is about (`None`: the whole).
#[derive(Debug)]
pub(crate) struct Located {
    /// Where in the text.
    pub span: Option<Range<usize>>,
    /// What is wrong.
    pub error: ConfigError,
}

impl Located {
    /// An error at `span`.
    pub fn at(span: Range<usize>, error: ConfigError) -> Located {
        Located {
            span: Some(span),
            error,
        }
    }

    /// The same place, another error (the one given, wrapped).
    pub fn map(self, f: impl FnOnce(ConfigError) -> ConfigError) -> Located {
        Located {
            span: self.span,
            error: f(self.error),
        }
    }
}

/// The 1-based line of byte `at` of `text`.
pub(crate) fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// A TOML value's type, in words.
pub(crate) fn type_name(v: &DeValue<'_>) -> &'static str {
    match v {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

/// A scalar's text as an error quotes it (`None` for arrays, tables and the types no
/// option takes).
pub(crate) fn scalar_text(v: &DeValue<'_>) -> Option<String> {
    match v {
        DeValue::String(s) => Some(s.to_string()),
        DeValue::Integer(n) => Some(n.to_string()),
        DeValue::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// An array's items as an error quotes them (`10.0.0.5, 2001:db8::5`).
fn array_text(items: &[Spanned<DeValue<'_>>]) -> String {
    items
        .iter()
        .map(|i| scalar_text(i.get_ref()).unwrap_or_else(|| type_name(i.get_ref()).into()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A TOML syntax error, at its place.
pub(crate) fn syntax(e: &toml::de::Error) -> Located {
    Located {
        span: e.span(),
        error: ConfigError::Toml(e.message().trim_end().to_string()),
    }
}

/// Deserializes `T` from `table`; an error names its key: an unknown key with the keys
/// there are (`expected`), a value of a type no option takes with its type, and a value
/// its parser refuses with the parser's word.
pub(crate) fn from_table<'i, T: DeserializeOwned>(
    table: Spanned<DeTable<'i>>,
    expected: impl FnOnce() -> String,
) -> Result<T, Located> {
    let keys = table.get_ref().clone();
    T::deserialize(toml::de::Deserializer::from(table)).map_err(|e| locate(&keys, &e, expected))
}

/// The key of `table` that error `e` is about, and the error as a [`ConfigError`].
fn locate(table: &DeTable<'_>, e: &toml::de::Error, expected: impl FnOnce() -> String) -> Located {
    let Some(at) = e.span() else {
        return syntax(e);
    };
    let within = |s: Range<usize>| s.start <= at.start && at.end <= s.end;
    for (k, v) in table.iter() {
        let key = k.get_ref().to_string();
        if k.span() == at {
            return Located::at(
                at,
                ConfigError::UnknownKey {
                    key,
                    expected: expected(),
                },
            );
        }
        if within(v.span()) {
            let error = match (scalar_text(v.get_ref()), v.get_ref()) {
                (Some(value), _) => ConfigError::BadValue {
                    key,
                    value,
                    why: e.message().to_string(),
                },
                // An array a key takes (`gid`) whose items its parser refused: serde's
                // own type errors start with "invalid type".
                (None, DeValue::Array(items)) if !e.message().starts_with("invalid type") => {
                    ConfigError::BadValue {
                        key,
                        value: format!("[{}]", array_text(items)),
                        why: e.message().to_string(),
                    }
                }
                (None, _) => ConfigError::WrongType {
                    key,
                    expected: "a string, an integer or a boolean",
                    found: type_name(v.get_ref()),
                },
            };
            return Located::at(v.span(), error);
        }
    }
    syntax(e)
}
