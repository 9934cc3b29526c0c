//! The `--config` file: TOML if its name ends in `.toml`, else the line format. Both are
//! read into the same typed options as the command line ([`Options`], by serde, unknown
//! keys refused) and VMs ([`VmSpec`], each as `--vm` is checked); an error names the
//! file, the line and the key.

use std::path::Path;
use std::str::FromStr;

use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::ConfigError;
use super::cli::{Options, config_keys};
use super::located::{self, Located};
use super::vm::{VmSpec, vm_tables};

/// What a config file configures.
#[derive(Debug, Default)]
pub(super) struct FileConfig {
    /// Its VMs, in order.
    pub vms: Vec<VmSpec>,
    /// Its options.
    pub options: Options,
}

/// Reads a config file: TOML if its name ends in `.toml`, else the line format.
pub(super) fn read(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
        path: path.to_path_buf(),
        error: e.to_string(),
    })?;
    let read = if path.extension().is_some_and(|e| e == "toml") {
        read_toml(&text)
    } else {
        read_lines(&text)
    };
    read.map_err(|l| ConfigError::InFile {
        path: path.to_path_buf(),
        line: l.span.map(|s| located::line_of(&text, s.start)),
        source: Box::new(l.error),
    })
}

/// The top-level keys there are, for an unknown key's error.
fn top_level_keys() -> String {
    format!("[[vm]] or {}", config_keys().join(", "))
}

/// The TOML format: top-level keys are the long options (`policy = "default"`,
/// `bind-port = 4791`, `rx-backlog-bytes = "32M"`), one `[[vm]]` table per VM with the
/// `--vm` keys (`socket`, `gid`, `name`, `qpn-base`, ...). A value is a string, or an
/// integer or a boolean, taken as the text the command line would give.
fn read_toml(text: &str) -> Result<FileConfig, Located> {
    let doc = DeTable::parse(text).map_err(|e| located::syntax(&e))?;
    let span = doc.span();
    let mut table = doc.into_inner();
    if let Some(v) = table.get("config") {
        return Err(Located::at(
            v.span(),
            ConfigError::bad(
                "config",
                &located::scalar_text(v.get_ref()).unwrap_or_default(),
                "a config file cannot include another",
            ),
        ));
    }
    check_mode_literals(text, &table)?;
    let vms = match table.remove("vm") {
        Some(v) => vm_tables(&v)?,
        None => Vec::new(),
    };
    let options = located::from_table(Spanned::new(span, table), top_level_keys)?;
    Ok(FileConfig { vms, options })
}

/// The options that take permission bits.
const MODE_KEYS: [&str; 2] = ["socket-mode", "control-mode"];

/// TOML reads `0o660` and `432` as the same number, so the integer's literal decides:
/// an octal literal is taken, any other integer is refused, since an operator who writes
/// `660` means octal and TOML would read it as decimal.
fn check_mode_literals(text: &str, table: &DeTable<'_>) -> Result<(), Located> {
    for key in MODE_KEYS {
        let Some(v) = table.get(key) else { continue };
        let DeValue::Integer(n) = v.get_ref() else {
            continue;
        };
        if n.radix() == 8 {
            continue;
        }
        let raw = text.get(v.span()).unwrap_or_default().trim();
        return Err(Located::at(
            v.span(),
            ConfigError::bad(
                key,
                raw,
                format!(
                    "a TOML integer that is not an octal literal: write the permission bits \
                     in octal, {key} = 0o660 or {key} = \"0660\" (a bare {raw} is read as \
                     decimal)"
                ),
            ),
        ));
    }
    Ok(())
}

/// The line format: one option per line, as on the command line without the leading
/// dashes (`vm socket=...`, `policy default`, `rx-backlog=16`), `#` comments. A later
/// line's option wins over an earlier one's; VMs add up. Each line is a key and a string
/// value of the same table a TOML file's top level is, spanned where it is in the text.
fn read_lines(text: &str) -> Result<FileConfig, Located> {
    let mut table = DeTable::new();
    let mut vms = Vec::new();
    let mut at = 0;
    for raw in text.split_inclusive('\n') {
        let start = at;
        at += raw.len();
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // Where a piece of this line is in the text.
        let span = |piece: &str| {
            let from = start + (piece.as_ptr() as usize - raw.as_ptr() as usize);
            from..from + piece.len()
        };
        let (k, v) = match line.split_once(|c: char| c.is_whitespace() || c == '=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (line, None),
        };
        let k = k.trim_start_matches('-');
        let value = match (k, v) {
            ("config", _) => {
                return Err(Located::at(
                    span(line),
                    ConfigError::Invalid("a config file cannot include another".into()),
                ));
            }
            ("vm", Some(spec)) => {
                let vm = VmSpec::from_str(spec).map_err(|e| Located::at(span(spec), e))?;
                vms.push(vm);
                continue;
            }
            // A flag: `allow-world-access` alone is `allow-world-access true`.
            ("allow-world-access", None) => Spanned::new(span(k), DeValue::Boolean(true)),
            (_, None) => {
                return Err(Located::at(
                    span(k),
                    ConfigError::Invalid(format!("{k}: a value is required")),
                ));
            }
            (_, Some(v)) => Spanned::new(span(v), DeValue::String(v.into())),
        };
        table.remove(k);
        table.insert(Spanned::new(span(k), k.into()), value);
    }
    let options = located::from_table(Spanned::new(0..text.len(), table), top_level_keys)?;
    Ok(FileConfig { vms, options })
}
