//! Reading a spec file's JSON (or YAML read as JSON) into request fields,
//! one object at a time, so every refusal names the field at fault by its
//! path, e.g. `template.ports[1].port` or `listeners[0].protocol`.
//!
//! # Rules every spec shares
//! - Field names are those of the proto in snake_case, or in lowerCamel
//!   (`cpuMillis`); the same field in both spellings is refused.
//! - A field not among an object's known fields is refused, naming the
//!   fields that are.
//! - A `null` field counts as absent; an absent field takes the proto's
//!   default.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

/// A refused field: its path, and what is wrong with it.
pub(crate) type Refusal = (String, String);

/// The fields of one JSON object of a spec, by snake_case name, with the
/// path that leads to the object.
#[derive(Debug)]
pub(crate) struct Fields<'v> {
    path: String,
    values: BTreeMap<String, &'v Value>,
}

impl<'v> Fields<'v> {
    /// `value` as an object whose fields are all among `known`.
    pub(crate) fn of(value: &'v Value, path: &str, known: &[&str]) -> Result<Self, Refusal> {
        let Value::Object(map) = value else {
            return Err((shown_path(path), format!("must be an object, not {}", kind(value))));
        };
        let mut values = BTreeMap::new();
        for (key, field) in map {
            let name = snake_case(key);
            let at = join(path, key);
            if !known.contains(&name.as_str()) {
                return Err((at, format!("unknown field; the fields here are {}", known.join(", "))));
            }
            if field.is_null() {
                continue;
            }
            if values.insert(name, field).is_some() {
                return Err((at, "given twice, in snake_case and in lowerCamel".to_string()));
            }
        }
        Ok(Self { path: path.to_string(), values })
    }

    /// The path of field `name` of this object.
    pub(crate) fn at(&self, name: &str) -> String {
        join(&self.path, name)
    }

    /// Whether field `name` is given.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// Whether field `name` is given as a string.
    pub(crate) fn is_string(&self, name: &str) -> bool {
        matches!(self.values.get(name), Some(Value::String(_)))
    }

    /// A string; absent is empty.
    pub(crate) fn string(&self, name: &str) -> Result<String, Refusal> {
        match self.values.get(name) {
            None => Ok(String::new()),
            Some(Value::String(text)) => Ok(text.clone()),
            Some(other) => Err((self.at(name), format!("must be a string, not {}", kind(other)))),
        }
    }

    /// `true` or `false`; absent is false.
    pub(crate) fn flag(&self, name: &str) -> Result<bool, Refusal> {
        match self.values.get(name) {
            None => Ok(false),
            Some(Value::Bool(flag)) => Ok(*flag),
            Some(other) => Err((self.at(name), format!("must be true or false, not {}", kind(other)))),
        }
    }

    /// A whole number that fits `T`; absent is `None`.
    pub(crate) fn number<T: TryFrom<u64>>(&self, name: &str) -> Result<Option<T>, Refusal> {
        let Some(value) = self.values.get(name) else { return Ok(None) };
        whole(value, &self.at(name)).map(Some)
    }

    /// A list of strings; absent is empty.
    pub(crate) fn strings(&self, name: &str) -> Result<Vec<String>, Refusal> {
        self.list(name)?
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(text) => Ok(text.clone()),
                other => Err((format!("{}[{i}]", self.at(name)), format!("must be a string, not {}", kind(other)))),
            })
            .collect()
    }

    /// A list of whole numbers that fit `T`; absent is empty.
    pub(crate) fn numbers<T: TryFrom<u64>>(&self, name: &str) -> Result<Vec<T>, Refusal> {
        self.list(name)?.iter().enumerate().map(|(i, item)| whole(item, &format!("{}[{i}]", self.at(name)))).collect()
    }

    /// An object of strings; absent is empty.
    pub(crate) fn string_map(&self, name: &str) -> Result<HashMap<String, String>, Refusal> {
        let Some(value) = self.values.get(name) else { return Ok(HashMap::new()) };
        let Value::Object(map) = value else {
            return Err((self.at(name), format!("must be an object of strings, not {}", kind(value))));
        };
        map.iter()
            .map(|(key, item)| match item {
                Value::String(text) => Ok((key.clone(), text.clone())),
                other => Err((join(&self.at(name), key), format!("must be a string, not {}", kind(other)))),
            })
            .collect()
    }

    /// A nested object whose fields are all among `known`.
    pub(crate) fn object(&self, name: &str, known: &[&str]) -> Result<Option<Fields<'v>>, Refusal> {
        self.values.get(name).map(|value| Fields::of(value, &self.at(name), known)).transpose()
    }

    /// A list of objects whose fields are all among `known`; absent is empty.
    pub(crate) fn objects(&self, name: &str, known: &[&str]) -> Result<Vec<Fields<'v>>, Refusal> {
        self.list(name)?
            .iter()
            .enumerate()
            .map(|(i, item)| Fields::of(item, &format!("{}[{i}]", self.at(name)), known))
            .collect()
    }

    /// An enum value by its short name (`TCP`) or its proto name
    /// (`LISTENER_PROTOCOL_TCP`), in any case; absent is 0 (unspecified).
    pub(crate) fn enumeration(
        &self,
        name: &str,
        prefix: &str,
        parse: impl Fn(&str) -> Option<i32>,
    ) -> Result<i32, Refusal> {
        let text = self.string(name)?;
        if text.is_empty() {
            return Ok(0);
        }
        let upper = text.to_ascii_uppercase().replace('-', "_");
        let full = if upper.starts_with(prefix) { upper } else { format!("{prefix}{upper}") };
        match parse(&full) {
            Some(value) if value != 0 => Ok(value),
            _ => Err((self.at(name), format!("{text:?} is not one of the values this field takes"))),
        }
    }

    fn list(&self, name: &str) -> Result<&'v [Value], Refusal> {
        match self.values.get(name) {
            None => Ok(&[]),
            Some(Value::Array(items)) => Ok(items.as_slice()),
            Some(other) => Err((self.at(name), format!("must be a list, not {}", kind(other)))),
        }
    }
}

/// `value` as a whole number that fits `T`, refused at `at` otherwise.
fn whole<T: TryFrom<u64>>(value: &Value, at: &str) -> Result<T, Refusal> {
    let number =
        value.as_u64().ok_or_else(|| (at.to_string(), format!("must be a whole number, not {}", kind(value))))?;
    T::try_from(number).map_err(|_| (at.to_string(), format!("{number} is too large")))
}

/// `cpuMillis` as `cpu_millis`; snake_case names are left as they are.
fn snake_case(key: &str) -> String {
    let mut name = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            name.push('_');
            name.push(c.to_ascii_lowercase());
        } else {
            name.push(c);
        }
    }
    name
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() { field.to_string() } else { format!("{path}.{field}") }
}

/// A path for messages: the file itself when empty.
pub(crate) fn shown_path(path: &str) -> String {
    if path.is_empty() { "the file".to_string() } else { path.to_string() }
}

/// What a JSON value is, with the value when short, for a refusal.
pub(crate) fn kind(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(flag) => format!("{flag}"),
        Value::Number(number) => format!("the number {number}"),
        Value::String(text) if text.chars().count() <= 40 => format!("the string {text:?}"),
        Value::String(_) => "a string".to_string(),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn numbers_name_the_item_at_fault_and_what_is_too_large() {
        let value = json!({"ports": [80, 70000], "replicas": -1});
        let fields = Fields::of(&value, "spec", &["ports", "replicas"]).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(fields.numbers::<u16>("ports").unwrap_err(), ("spec.ports[1]".into(), "70000 is too large".into()));
        assert_eq!(fields.numbers::<u32>("ports"), Ok(vec![80, 70000]));
        let refused = fields.number::<u32>("replicas").unwrap_err();
        assert_eq!(refused, ("spec.replicas".into(), "must be a whole number, not the number -1".into()));
        assert_eq!(fields.number::<u32>("absent"), Ok(None));
    }

    #[test]
    fn lower_camel_reads_as_snake_case_and_both_at_once_are_refused() {
        let value = json!({"cpuMillis": 5});
        let fields = Fields::of(&value, "", &["cpu_millis"]).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(fields.has("cpu_millis"));
        let twice = json!({"cpuMillis": 5, "cpu_millis": 6});
        let refused = Fields::of(&twice, "", &["cpu_millis"]).unwrap_err();
        assert!(refused.1.contains("given twice"), "{refused:?}");
        let refused = Fields::of(&json!([1]), "", &[]).unwrap_err();
        assert_eq!(refused, ("the file".into(), "must be an object, not a list".into()));
    }
}
