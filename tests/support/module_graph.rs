//! The module graph of a crate, read from its source: which top-level
//! modules each module's non-test code names through `crate::` paths. Used
//! by each crate's `tests/layers.rs` (included with `#[path]`), which fail
//! on a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module -> the modules its non-test code names with `crate::`. Test code
/// may use anything: an item under `#[cfg(test)]` (a `mod tests { .. }`, a
/// helper `fn`) is skipped to its closing brace, and a file declared as
/// `#[cfg(test)] mod name;` is not read, nor anything under it; everything
/// else is read to the end of its file.
pub fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let files = rust_files(src);
    let mut test_only: Vec<PathBuf> = Vec::new();
    let mut code: BTreeMap<PathBuf, String> = BTreeMap::new();
    for path in &files {
        let text = code_only(&std::fs::read_to_string(path).expect("read"));
        let (kept, test_modules) = without_test_items(&text, path);
        for name in test_modules {
            let dir = children_dir(src, path);
            test_only.push(dir.join(format!("{name}.rs")));
            test_only.push(dir.join(name));
        }
        code.insert(path.clone(), kept);
    }
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (path, code) in &code {
        if test_only.iter().any(|t| path.starts_with(t)) {
            continue;
        }
        let rel = path.strip_prefix(src).expect("under src");
        let top = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .expect("name")
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" {
            continue; // the wiring: it names every module
        }
        let names = deps.entry(top.clone()).or_default();
        for part in code.split("crate::").skip(1) {
            for name in first_names(part) {
                if name != top {
                    names.insert(name);
                }
            }
        }
    }
    deps
}

/// The names a path after `crate::` starts with: one (`crate::a::b`), or
/// each of a group's (`crate::{a, b::c}`), without the groups nested in them.
fn first_names(path: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let Some(group) = path.strip_prefix('{') else {
        return vec![ident(path)]
            .into_iter()
            .filter(|n| !n.is_empty())
            .collect();
    };
    let mut names = Vec::new();
    let (mut depth, mut item_start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                names.push(ident(&group[item_start..i]));
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                names.push(ident(&group[item_start..i]));
                item_start = i + 1;
            }
            _ => {}
        }
    }
    names.retain(|n| !n.is_empty() && n != "self");
    names
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// Where the files of `file`'s child modules live: beside it for `lib.rs`
/// and `mod.rs`, else in the directory named for it.
fn children_dir(src: &Path, file: &Path) -> PathBuf {
    let parent = file.parent().unwrap_or(src);
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("lib" | "mod") => parent.to_path_buf(),
        Some(stem) => parent.join(stem),
        None => parent.to_path_buf(),
    }
}

/// `text` without its `#[cfg(test)]` items, and the names of the modules
/// declared as `#[cfg(test)] mod name;` (whose files are test code).
fn without_test_items(text: &str, path: &Path) -> (String, Vec<String>) {
    let mut kept = String::with_capacity(text.len());
    let mut test_modules = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            kept.push_str(line);
            kept.push('\n');
            continue;
        }
        // The item under the attribute: further attributes, then its first line.
        let mut item = None;
        for next in lines.by_ref() {
            if !next.trim_start().starts_with("#[") {
                item = Some(next);
                break;
            }
        }
        let Some(first) = item else { break };
        let head = first.split('{').next().unwrap_or(first);
        if head.trim_end().ends_with(';') {
            if let Some(name) = head
                .trim_end()
                .trim_end_matches(';')
                .split_whitespace()
                .skip_while(|w| *w != "mod")
                .nth(1)
            {
                test_modules.push(name.to_string());
            }
            continue;
        }
        // A body: skip to the brace that closes it.
        let mut depth = braces(first);
        let mut opened = first.contains('{');
        while !opened || depth > 0 {
            let Some(next) = lines.next() else {
                panic!("{}: a #[cfg(test)] item never closes", path.display());
            };
            opened |= next.contains('{');
            depth += braces(next);
        }
    }
    (kept, test_modules)
}

/// `text` with the contents of comments, strings and character literals
/// blanked (line breaks kept), so that braces and `crate::` are counted
/// only where they are code.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let at = |j: usize| c.get(j).copied();
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        if c[i] == '/' && at(i + 1) == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && at(i + 1) == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == Some('*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == Some('/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
        } else if c[i] == 'r'
            && matches!(at(i + 1), Some('"' | '#'))
            && !ident(c.get(i.wrapping_sub(1)))
        {
            // A raw string: r"..." or r#"..."#, no escapes.
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            if at(i + 1 + hashes) != Some('"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            i += 2 + hashes;
            while i < c.len() {
                if c[i] == '"'
                    && c[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes
                {
                    i += 1 + hashes;
                    break;
                }
                blank(&mut out, c[i]);
                i += 1;
            }
            out.push_str("\"\"");
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                if let Some(&ch) = c.get(i) {
                    blank(&mut out, ch);
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && (at(i + 2) == Some('\'') || at(i + 1) == Some('\\')) {
            // A character literal ('{', '\n', '\u{7b}'); a lifetime has no
            // closing quote right after one character.
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Whether `c` can be part of an identifier (so `r"` is not a raw string).
fn ident(c: Option<&char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || *c == '_')
}

/// Opening minus closing braces on a line.
fn braces(line: &str) -> i64 {
    line.chars()
        .map(|c| match c {
            '{' => 1,
            '}' => -1,
            _ => 0,
        })
        .sum()
}

/// A path from `from` back to `to`, if any.
fn path(
    deps: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in deps.get(from).into_iter().flatten() {
        if let Some(mut p) = path(deps, next, to, seen) {
            p.insert(0, from.to_string());
            return Some(p);
        }
    }
    None
}

/// Every module that reaches itself through others, each with one such
/// path (`a -> b -> a`), in name order; empty when the modules form layers.
pub fn cycles(deps: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut found = Vec::new();
    for (module, names) in deps {
        for next in names {
            if let Some(cycle) = path(deps, next, module, &mut BTreeSet::new()) {
                found.push(format!("{module} -> {}", cycle.join(" -> ")));
                break;
            }
        }
    }
    found
}
