//! No import circles: in every crate of the workspace, no file imports a file that
//! imports it back, directly or around a loop.
//!
//! Each crate's module tree is read from its roots (`src/lib.rs`, `src/main.rs`,
//! `src/bin/*.rs`) through its `mod NAME;` declarations; modules declared under
//! `#[cfg(test)]`, and `#[cfg(test)] mod NAME { .. }` blocks, are left out (tests may
//! import anything). A file imports another when it names it by a path, in a `use` or in
//! code, that starts with `crate::`, `super::` or `self::`; the path is resolved to the
//! file that holds the longest module prefix of it. A `mod` declaration is not an
//! import, nor is a module naming its own children by a bare path (`pub use
//! split::Virtq;`, the module's facade). Comments and string literals are skipped. A
//! circle is a strongly connected component of two or more files.
//!
//! The reading is lexical, not the compiler's: a path built by a macro is not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Circles that exist and are allowed for now: (crate directory, its files from the
/// crate directory, sorted). Each entry is a debt to pay, not a rule: a circle that is
/// not listed fails the test, and so does an entry whose circle is gone, so the list
/// only shrinks.
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[];

/// A module path from the crate root (`["port", "soft"]`).
type ModPath = Vec<String>;

/// One crate's files: the module each one holds, and its text without comments,
/// string literals and test modules.
#[derive(Debug, Default)]
struct Crate {
    files: BTreeMap<ModPath, (PathBuf, String)>,
}

/// The import graph of a crate: file -> file -> the names that tie them.
type Graph = BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>;

#[test]
fn no_crate_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the lab crate is in the workspace");
    let members = workspace_members(&root.join("Cargo.toml"));
    for needed in ["wire", "backend", "guest-driver", "tests"] {
        assert!(
            members.iter().any(|m| m == needed),
            "{needed} is not a workspace member: {members:?}"
        );
    }
    let mut report = Vec::new();
    let mut seen_known = BTreeSet::new();
    for member in &members {
        let dir = root.join(member);
        let crates = read_crates(&dir);
        assert!(!crates.is_empty(), "{member}: no crate root found");
        let mut graph = Graph::new();
        for krate in &crates {
            for (file, edges) in imports(krate) {
                graph.entry(file).or_default().extend(edges);
            }
        }
        for circle in circles(&graph) {
            let names: Vec<String> = circle
                .iter()
                .map(|f| f.strip_prefix(&dir).unwrap_or(f).display().to_string())
                .collect();
            let known = KNOWN_CIRCLES
                .iter()
                .position(|(c, files)| c == member && *files == names.as_slice());
            match known {
                Some(i) => {
                    seen_known.insert(i);
                }
                None => report.push(describe(member, &dir, &circle, &graph)),
            }
        }
    }
    for (i, (c, files)) in KNOWN_CIRCLES.iter().enumerate() {
        if !seen_known.contains(&i) {
            report.push(format!(
                "{c}: the known circle {files:?} is gone: remove it from KNOWN_CIRCLES"
            ));
        }
    }
    assert!(report.is_empty(), "import circles:\n{}", report.join("\n"));
}

#[test]
fn a_circle_through_use_groups_code_and_self_paths_is_found() {
    let krate = crate_of(&[
        (
            "lib.rs",
            "pub mod a;\npub mod b;\npub mod c;\n#[cfg(test)]\nmod t;\n",
        ),
        ("a.rs", "use crate::b::{self, Thing as T};\n"),
        ("b/mod.rs", "mod inner;\npub use inner::Deep;\n"),
        (
            "b/inner.rs",
            "fn f() { let _ = super::super::c::make(); }\n",
        ),
        // A comment, a string and a test module do not import.
        (
            "c.rs",
            "// crate::a::X\nconst S: &str = \"crate::a::Y\";\n\
             #[cfg(test)]\nmod tests { use crate::a::Z; }\n",
        ),
        ("t.rs", "use crate::a::W;\n"),
    ]);
    let g = imports(&krate);
    assert!(circles(&g).is_empty(), "{g:?}");

    let krate = crate_of(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
        ("a.rs", "use crate::b::{self, Thing as T};\n"),
        ("b/mod.rs", "mod inner;\npub use self::inner::Deep;\n"),
        (
            "b/inner.rs",
            "fn f() { let _ = super::super::c::make(); }\n",
        ),
        ("c.rs", "pub fn make() -> crate::a::X { todo!() }\n"),
    ]);
    let g = imports(&krate);
    let found = circles(&g);
    let expect: Vec<PathBuf> = ["src/a.rs", "src/b/inner.rs", "src/b/mod.rs", "src/c.rs"]
        .into_iter()
        .map(PathBuf::from)
        .collect();
    assert_eq!(found, vec![expect], "{g:?}");
}

/// The crate of in-memory `files` (paths below `src/`).
fn crate_of(files: &[(&str, &str)]) -> Crate {
    let text: BTreeMap<PathBuf, String> = files
        .iter()
        .map(|(p, t)| (Path::new("src").join(p), (*t).to_string()))
        .collect();
    build_crate(Path::new("src/lib.rs"), &|p: &Path| text.get(p).cloned())
}

/// The `members` of the workspace manifest at `path`.
fn workspace_members(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).expect("the workspace manifest reads");
    let start = text.find("members").expect("a members list");
    let list = &text[start..];
    let open = list.find('[').expect("members = [");
    let close = list.find(']').expect("members = [...]");
    list[open + 1..close]
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect()
}

/// The crates in directory `dir` (its library and each binary), read from disk.
fn read_crates(dir: &Path) -> Vec<Crate> {
    let src = dir.join("src");
    let mut roots = vec![src.join("lib.rs"), src.join("main.rs")];
    if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> = bins.filter_map(|e| e.ok().map(|e| e.path())).collect();
        bins.retain(|b| b.extension().is_some_and(|e| e == "rs"));
        bins.sort();
        roots.extend(bins);
    }
    roots
        .iter()
        .filter(|r| r.is_file())
        .map(|r| build_crate(r, &|p: &Path| std::fs::read_to_string(p).ok()))
        .collect()
}

/// Walks the module tree from the crate root `root`, reading each file through `read`.
fn build_crate(root: &Path, read: &dyn Fn(&Path) -> Option<String>) -> Crate {
    let mut krate = Crate::default();
    let mut todo: Vec<(ModPath, PathBuf)> = vec![(Vec::new(), root.to_path_buf())];
    while let Some((module, path)) = todo.pop() {
        let Some(text) = read(&path) else { continue };
        let text = strip_tests(&strip_comments_and_strings(&text));
        // The children of DIR/mod.rs and of a crate root are in DIR/, else in STEM/.
        let base = path.parent().unwrap_or(Path::new(""));
        let child_dir = match path.file_stem().and_then(|s| s.to_str()) {
            Some("mod") => base.to_path_buf(),
            _ if module.is_empty() => base.to_path_buf(),
            Some(stem) => base.join(stem),
            None => base.to_path_buf(),
        };
        for child in declared_modules(&text) {
            let mut m = module.clone();
            m.push(child.clone());
            let flat = child_dir.join(format!("{child}.rs"));
            let nested = child_dir.join(&child).join("mod.rs");
            let file = if read(&flat).is_some() { flat } else { nested };
            todo.push((m, file));
        }
        krate.files.insert(module, (path, text));
    }
    krate
}

/// The names of the file's `mod NAME;` declarations (test modules are already gone).
fn declared_modules(text: &str) -> Vec<String> {
    let words = tokens(text);
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if w == "mod" && words.get(i + 2).is_some_and(|t| t == ";") {
            if let Some(name) = words.get(i + 1).filter(|n| is_ident(n)) {
                out.push(name.clone());
            }
        }
    }
    out
}

/// The graph of imports between the crate's files.
fn imports(krate: &Crate) -> Graph {
    let mut graph = Graph::new();
    for (module, (path, text)) in &krate.files {
        let edges = graph.entry(path.clone()).or_default();
        for segs in paths(text) {
            let (mut base, mut rest) = match segs[0].as_str() {
                "crate" => (Vec::new(), &segs[1..]),
                "self" => (module.clone(), &segs[1..]),
                "super" => (module.clone(), &segs[..]),
                _ => continue,
            };
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            base.extend(rest.iter().cloned());
            // The longest prefix that is a module of the crate.
            let target = (0..=base.len())
                .rev()
                .find_map(|n| krate.files.get(&base[..n]).map(|(p, _)| (n, p)));
            if let Some((n, target)) = target.filter(|(_, t)| *t != path) {
                let name = base.get(n).or(base.last()).cloned().unwrap_or_default();
                edges.entry(target.clone()).or_default().insert(name);
            }
        }
    }
    graph
}

/// Every path of two or more segments in `text`, with `use` groups expanded
/// (`a::{b, c::d}` gives `a::b` and `a::c::d`).
fn paths(text: &str) -> Vec<Vec<String>> {
    let toks = tokens(text);
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let starts = is_ident(&toks[i])
            && toks.get(i + 1).is_some_and(|t| t == "::")
            && (i == 0 || toks[i - 1] != "::");
        if starts {
            i = path_tree(&toks, i, Vec::new(), &mut out);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads the path (or `use` tree) at `toks[i]` under `prefix` into `out`; returns the
/// index after it.
fn path_tree(
    toks: &[String],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    while let Some(t) = toks.get(i) {
        if is_ident(t) {
            prefix.push(t.clone());
            i += 1;
        } else if t == "{" {
            // A group: each item is a tree of its own under the prefix.
            i += 1;
            while let Some(t) = toks.get(i) {
                match t.as_str() {
                    "}" => return i + 1,
                    "," => i += 1,
                    _ => i = path_tree(toks, i, prefix.clone(), out),
                }
            }
            return i;
        } else {
            break;
        }
        if toks.get(i).is_some_and(|t| t == "::") {
            i += 1;
        } else {
            break;
        }
    }
    // `self` in a group names the prefix itself.
    if prefix.last().is_some_and(|s| s == "self") && prefix.len() > 1 {
        prefix.pop();
    }
    if toks.get(i).is_some_and(|t| t == "as") {
        i += 2;
    }
    if prefix.len() >= 2 || prefix.first().is_some_and(|s| s != "self") {
        out.push(prefix);
    }
    i
}

fn is_ident(t: &str) -> bool {
    t.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && t.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// Identifiers, `::` and single punctuation characters.
fn tokens(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(c.to_string());
            }
            i += 1;
        }
    }
    out
}

/// `text` without comments, string literals (raw ones included) and char literals.
fn strip_comments_and_strings(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if c.get(i + 1) == Some(&'*') => {
                let mut depth = 0;
                while i < c.len() {
                    if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            'r' if raw_string_hashes(&c, i).is_some() => {
                let hashes = raw_string_hashes(&c, i).unwrap_or(0);
                i += 2 + hashes;
                while i < c.len() {
                    if c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#')) {
                        i += 1 + hashes;
                        break;
                    }
                    i += 1;
                }
                out.push_str("\"\"");
            }
            '"' => {
                i += 1;
                while i < c.len() && c[i] != '"' {
                    i += if c[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            '\'' if c.get(i + 1) == Some(&'\\') => {
                // An escaped char literal: past the escaped character, up to its
                // closing quote.
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            }
            '\'' if c.get(i + 2) == Some(&'\'') => i += 3,
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// At `c[i] == 'r'`: the number of `#` of a raw string literal starting there, if one
/// does (and `r` is not the end of an identifier).
fn raw_string_hashes(c: &[char], i: usize) -> Option<usize> {
    let ident = |k: usize| c[k].is_alphanumeric() || c[k] == '_';
    // `r"` and `br"` start one; `xr"` is an identifier and a string.
    if i > 0 && ident(i - 1) && !(c[i - 1] == 'b' && (i < 2 || !ident(i - 2))) {
        return None;
    }
    let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
    (c.get(i + 1 + hashes) == Some(&'"')).then_some(hashes)
}

/// `text` without `#[cfg(test)]` modules: their blocks, and their `mod NAME;`
/// declarations.
fn strip_tests(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let toks_end = after.find(['{', ';']).map_or(after.len(), |e| e);
        let head = &after[..toks_end];
        let is_mod = tokens(head).iter().any(|t| t == "mod");
        if !is_mod {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        if after[toks_end..].starts_with(';') {
            rest = &after[toks_end + 1..];
            continue;
        }
        // Skip the block, braces balanced (strings are already gone).
        let mut depth = 0;
        let mut end = after.len();
        for (k, ch) in after[toks_end..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = toks_end + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The strongly connected components of two or more files (Tarjan), each sorted.
fn circles(graph: &Graph) -> Vec<Vec<PathBuf>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g PathBuf, usize>,
        low: BTreeMap<&'g PathBuf, usize>,
        stack: Vec<&'g PathBuf>,
        on: BTreeSet<&'g PathBuf>,
        out: Vec<Vec<PathBuf>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g PathBuf) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    comp.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out.sort();
    t.out
}

/// A circle and the names that tie its files.
fn describe(member: &str, dir: &Path, circle: &[PathBuf], graph: &Graph) -> String {
    let rel = |p: &Path| p.strip_prefix(dir).unwrap_or(p).display().to_string();
    let files: Vec<String> = circle.iter().map(|f| rel(f)).collect();
    let mut s = format!(
        "{member}: circle of {} files: {}",
        circle.len(),
        files.join(", ")
    );
    for f in circle {
        for (t, names) in graph.get(f).into_iter().flatten() {
            if circle.contains(t) {
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                s.push_str(&format!(
                    "\n    {} -> {}: {}",
                    rel(f),
                    rel(t),
                    names.join(", ")
                ));
            }
        }
    }
    s
}
