//! Spec files as `berth service apply` and `berth egress apply` read them:
//! the file (or stdin) and the flags that name what it declares, read and
//! parsed into one JSON value before anything is dialled.
//!
//! # What a spec file may be
//! JSON or YAML. A `.yaml` or `.yml` file is read as YAML, a `.json` file
//! as JSON, and anything else (stdin too) as JSON when it starts with `{`
//! and as YAML otherwise. Both become the same JSON value, which each
//! command converts field by field: a syntax error names its line and
//! column, a key given twice names the key. YAML values keep their YAML
//! types (`replicas: 2` is a number).
//!
//! # Invariants
//! - A file larger than the largest request a server takes, or nesting
//!   YAML flow collections deeper than [`MAX_FLOW_DEPTH`], is refused before
//!   it is parsed.

use std::io::Read as _;

use serde_json::Value;

/// The spec file of an apply and the flags that name what it declares.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct SpecFileArgs {
    /// The spec: a JSON or YAML file (`.json`, `.yaml`, `.yml`), or `-` for
    /// stdin.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    pub(super) file: String,
    /// Its name, when the file does not name it (or to check the file's
    /// name).
    #[arg(long, value_name = "NAME")]
    pub(super) name: Option<String>,
    /// Its project, when the file does not name one [default: default].
    #[arg(long, value_name = "PROJECT")]
    pub(super) project: Option<String>,
}

/// Why a spec file was refused. Each message names the file and,
/// when one field is at fault, that field's path.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpecError {
    /// The file (or stdin) could not be read.
    #[error("cannot read {file}: {source}")]
    Read {
        /// The file, or "stdin".
        file: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is read as JSON and is not JSON.
    #[error("{file} is not JSON: {source}{hint}")]
    Syntax {
        /// The file, or "stdin".
        file: String,
        /// Where the parser stopped.
        #[source]
        source: serde_json::Error,
        /// A hint when the file looks like YAML.
        hint: &'static str,
    },
    /// The file is read as YAML and is not YAML that holds a spec.
    #[error("{file} is not a YAML spec: {source}")]
    YamlSyntax {
        /// The file, or "stdin".
        file: String,
        /// Where the parser stopped; its message names the line and column.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// A field is unknown, missing or holds a value of the wrong type.
    #[error("{file}: {path}: {problem}")]
    Field {
        /// The file, or "stdin".
        file: String,
        /// The field's path, e.g. `template.replicas`.
        path: String,
        /// What is wrong with it.
        problem: String,
    },
}

/// The file `file` names (`-`: stdin), parsed; with its name for messages.
pub(super) fn read(file: &str) -> Result<(String, Value), SpecError> {
    let (file, text) = if file == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|source| SpecError::Read { file: "stdin".to_string(), source })?;
        ("stdin".to_string(), text)
    } else {
        let text =
            std::fs::read_to_string(file).map_err(|source| SpecError::Read { file: file.to_string(), source })?;
        (file.to_string(), text)
    };
    let value = parse(&file, &text)?;
    Ok((file, value))
}

/// How a spec file is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpecSyntax {
    Json,
    Yaml,
}

impl SpecSyntax {
    /// By the file's extension, else by its first character (see the module docs).
    fn of(file: &str, text: &str) -> Self {
        let lower = file.to_ascii_lowercase();
        if lower.ends_with(".yaml") || lower.ends_with(".yml") {
            Self::Yaml
        } else if lower.ends_with(".json") || text.trim_start().starts_with('{') {
            Self::Json
        } else {
            Self::Yaml
        }
    }
}

/// The deepest nesting of YAML flow collections in `text`, counting `{`
/// and `[` outside quoted scalars and comments. A quote opens a quoted
/// scalar only where a scalar may start (after whitespace, `[`, `{` or
/// `,`), so an apostrophe inside a plain word does not.
fn flow_depth(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut quote: Option<char> = None;
    let mut prev = '\n';
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some('"') if c == '\\' => {
                chars.next();
            }
            Some('\'') if c == '\'' && chars.peek() == Some(&'\'') => {
                chars.next();
            }
            Some(open) if c == open => quote = None,
            Some(_) => {}
            None => match c {
                '"' | '\'' if prev.is_whitespace() || matches!(prev, '[' | '{' | ',') => quote = Some(c),
                '#' if prev.is_whitespace() => {
                    for skipped in chars.by_ref() {
                        if skipped == '\n' {
                            break;
                        }
                    }
                }
                '[' | '{' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            },
        }
        prev = c;
    }
    deepest
}

/// The largest spec file read: far above any real declaration, and at the
/// size of the largest request the server takes.
const MAX_SPEC_BYTES: usize = berth_rpc::MAX_REQUEST_BYTES;

/// How deep YAML flow collections (`{…}`, `[…]`) may nest. The YAML parser
/// takes time quadratic in that depth, so a file nesting them thousands deep
/// is refused before it is parsed; real specs nest a few levels.
const MAX_FLOW_DEPTH: usize = 64;

/// `text` parsed as the syntax its name or contents say, into one JSON value.
pub(super) fn parse(file: &str, text: &str) -> Result<Value, SpecError> {
    let refused = |problem: String| SpecError::Field { file: file.to_string(), path: "the file".to_string(), problem };
    if text.len() > MAX_SPEC_BYTES {
        return Err(refused(format!("is {} bytes; a spec may be at most {MAX_SPEC_BYTES}", text.len())));
    }
    let syntax = SpecSyntax::of(file, text);
    if syntax == SpecSyntax::Yaml && flow_depth(text) > MAX_FLOW_DEPTH {
        return Err(refused(format!("nests {{ and [ collections more than {MAX_FLOW_DEPTH} levels deep")));
    }
    match syntax {
        SpecSyntax::Json => serde_json::from_str(text).map_err(|source| {
            let hint = if text.trim_start().starts_with('{') {
                ""
            } else {
                " (a .json file is read as JSON; name a YAML spec .yaml or .yml)"
            };
            SpecError::Syntax { file: file.to_string(), source, hint }
        }),
        SpecSyntax::Yaml => {
            // Through YAML's own value first, which refuses a key given twice.
            let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
                .map_err(|source| SpecError::YamlSyntax { file: file.to_string(), source })?;
            serde_json::to_value(yaml).map_err(|error| SpecError::Field {
                file: file.to_string(),
                path: "the file".to_string(),
                problem: format!("holds what a JSON spec cannot: {error}"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_syntax_follows_the_extension_then_the_first_character() {
        assert_eq!(SpecSyntax::of("s.yaml", "{}"), SpecSyntax::Yaml);
        assert_eq!(SpecSyntax::of("s.YML", ""), SpecSyntax::Yaml);
        assert_eq!(SpecSyntax::of("s.json", "replicas: 2"), SpecSyntax::Json);
        assert_eq!(SpecSyntax::of("stdin", "  {\"replicas\": 2}"), SpecSyntax::Json);
        assert_eq!(SpecSyntax::of("stdin", "replicas: 2"), SpecSyntax::Yaml);
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_the_yaml_parser_sees_it() {
        let deep = format!("{}{}", "{a: ".repeat(40_000), "}".repeat(40_000));
        // Our refusal, not the parser's: it never reached the parser.
        let Err(SpecError::Field { path, problem, .. }) = parse("deep.yaml", &deep) else {
            panic!("a 40,000-deep spec is refused")
        };
        assert_eq!(path, "the file");
        assert!(problem.contains("more than 64 levels deep"), "{problem}");

        assert_eq!(flow_depth("args: [a, {b: \"{{{\"}, '[[it''s]]']\nenv: {A: \"}\"} # [[[[\nname: it's{"), 2);
        let fine = "args: [a, {b: [c]}]\nenv:\n  A: \"{{{{\"\n";
        assert!(parse("fine.yaml", fine).is_ok(), "quoted braces and shallow nesting are fine");
        let big = " ".repeat(MAX_SPEC_BYTES + 1);
        assert!(matches!(parse("big.yaml", &big), Err(SpecError::Field { .. })));
    }

    #[test]
    fn a_yaml_syntax_error_names_its_line() {
        let error = parse("s.yaml", "name: web\ntemplate:\n  replicas: [1\n").unwrap_err().to_string();
        assert!(error.starts_with("s.yaml is not a YAML spec: "), "{error}");
        assert!(error.contains("line 4"), "{error}");
        let error = parse("s.yaml", "name: a\nname: b\n").unwrap_err().to_string();
        assert_eq!(error, "s.yaml is not a YAML spec: duplicate entry with key \"name\"");
        let error = parse("s.yaml", "name: a\n[1]: b\n").unwrap_err().to_string();
        assert!(error.starts_with("s.yaml: the file: holds what a JSON spec cannot"), "{error}");
    }
}
