//! From a source file's text to the paths it names: comments and `#[cfg(test)]` modules
//! dropped, `use` trees expanded, inline `crate::` / `super::` / `self::` paths collected.
//!
//! A hand-written scanner, not a parser: it knows comments, string and char literals, brace
//! nesting and the shape of a `use` tree, which is all the import graph needs.

/// One path a `use` item brings in: its segments and the name it is known by here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsePath {
    /// The path's segments, e.g. `["crate", "mr", "Mr"]`; a trailing `self` is dropped.
    pub segments: Vec<String>,
    /// The name bound in the importing module: the alias after `as`, else the last segment.
    pub name: String,
    /// Whether the item is `pub` (a re-export), `pub(crate)` and the like included.
    pub public: bool,
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` as code only: comments removed (a block comment becomes a space), the contents of
/// string and char literals removed (their quotes stay), lifetimes kept.
pub fn code_only(text: &str) -> String {
    let s: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        let next = s.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i = skip_block_comment(&s, i);
            out.push(' ');
        } else if c == '"' {
            i = skip_string(&s, i + 1);
            out.push_str("\"\"");
        } else if let Some(end) = raw_string_end(&s, i) {
            i = end;
            out.push_str("\"\"");
        } else if c == '\'' {
            match char_literal_end(&s, i) {
                Some(end) => {
                    i = end;
                    out.push_str("''");
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The index after the (nested) block comment that opens at `start`.
fn skip_block_comment(s: &[char], start: usize) -> usize {
    let mut depth = 0;
    let mut i = start;
    while i < s.len() {
        if s[i] == '/' && s.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The index after the closing quote of a string whose contents start at `i`.
fn skip_string(s: &[char], mut i: usize) -> usize {
    while i < s.len() {
        match s[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// When a raw string (`r"…"`, `r#"…"#`, `br"…"`) opens at `i`: the index after it.
fn raw_string_end(s: &[char], i: usize) -> Option<usize> {
    if s[i] != 'r' {
        return None;
    }
    let prefix_ok = match i.checked_sub(1).map(|p| s[p]) {
        None => true,
        Some('b') => i < 2 || !is_ident(s[i - 2]),
        Some(p) => !is_ident(p),
    };
    if !prefix_ok {
        return None;
    }
    let mut j = i + 1;
    while s.get(j) == Some(&'#') {
        j += 1;
    }
    if s.get(j) != Some(&'"') {
        return None;
    }
    let hashes = j - i - 1;
    j += 1;
    while j < s.len() {
        if s[j] == '"' && (0..hashes).all(|k| s.get(j + 1 + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// When a char literal opens at `i` (not a lifetime): the index after it.
fn char_literal_end(s: &[char], i: usize) -> Option<usize> {
    match s.get(i + 1)? {
        '\\' => {
            let mut j = i + 3;
            while j < s.len() && s[j] != '\'' {
                j += 1;
            }
            Some(j + 1)
        }
        _ if s.get(i + 2) == Some(&'\'') => Some(i + 3),
        _ => None,
    }
}

/// `code` (from [`code_only`]) without `#[cfg(test)]` modules (inline ones with their
/// bodies, and `mod name;` declarations), and the names those declarations give: their
/// files are test code too. Other attributes between the `cfg` and the `mod` are allowed.
pub fn without_test_modules(code: &str) -> (String, Vec<String>) {
    const CFG_TEST: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut declared = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(CFG_TEST) {
        out.push_str(&rest[..at]);
        let after = &rest[at + CFG_TEST.len()..];
        match test_module(after) {
            Some(TestModule { len, declares }) => {
                declared.extend(declares);
                rest = &after[len..];
            }
            None => {
                out.push_str(CFG_TEST);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    (out, declared)
}

/// A `#[cfg(test)]` module item.
struct TestModule {
    /// Its length in bytes after the attribute.
    len: usize,
    /// For `mod name;`, the name.
    declares: Option<String>,
}

/// When `text` (what follows a `#[cfg(test)]`) is a module item: its extent.
fn test_module(text: &str) -> Option<TestModule> {
    let mut i = skip_attributes(text);
    let mut word = next_word(&text[i..]);
    if word.1 == "pub" {
        i += word.0;
        let rest = &text[i..];
        if rest.trim_start().starts_with('(') {
            i += rest.find(')')? + 1;
        }
        word = next_word(&text[i..]);
    }
    if word.1 != "mod" {
        return None;
    }
    i += word.0;
    let name = next_word(&text[i..]);
    if name.1.is_empty() {
        return None;
    }
    i += name.0;
    let rest = &text[i..];
    let trimmed = rest.trim_start();
    i += rest.len() - trimmed.len();
    let (len, declares) = match trimmed.chars().next()? {
        ';' => (i + 1, Some(name.1.to_owned())),
        '{' => (i + matching_brace(trimmed)?, None),
        _ => return None,
    };
    Some(TestModule { len, declares })
}

/// The length of the leading white space and `#[...]` attributes of `text`.
fn skip_attributes(text: &str) -> usize {
    let mut i = 0;
    loop {
        let rest = &text[i..];
        let trimmed = rest.trim_start();
        i += rest.len() - trimmed.len();
        if !trimmed.starts_with("#[") {
            return i;
        }
        match matching_bracket(trimmed, '[', ']') {
            Some(len) => i += len,
            None => return i,
        }
    }
}

/// The next identifier of `text` after white space: (bytes up to its end, the identifier).
fn next_word(text: &str) -> (usize, &str) {
    let trimmed = text.trim_start();
    let skipped = text.len() - trimmed.len();
    let len = trimmed
        .find(|c: char| !is_ident(c))
        .unwrap_or(trimmed.len());
    (skipped + len, &trimmed[..len])
}

/// `text` opens with `{`: the length up to and including its matching `}`.
fn matching_brace(text: &str) -> Option<usize> {
    matching_bracket(text, '{', '}')
}

/// The length of `text` up to the bracket that closes the first `open`.
fn matching_bracket(text: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth = depth.checked_sub(1)?;
            if depth == 0 {
                return Some(i + c.len_utf8());
            }
        }
    }
    None
}

/// Every path of every `use` item of `code`, grouped trees expanded.
pub fn use_paths(code: &str) -> Vec<UsePath> {
    let mut paths = Vec::new();
    let chars: Vec<(usize, char)> = code.char_indices().collect();
    for (k, &(at, _)) in chars.iter().enumerate() {
        if !code[at..].starts_with("use") {
            continue;
        }
        let before = k.checked_sub(1).map(|p| chars[p].1);
        let after = code[at + 3..].chars().next();
        if before.is_some_and(is_ident) || !after.is_some_and(char::is_whitespace) {
            continue;
        }
        let Some(len) = code[at..].find(';') else {
            continue;
        };
        let public = is_public(&code[..at]);
        expand_tree("", &code[at + 3..at + len], public, &mut paths);
    }
    paths
}

/// Whether the item whose `use` keyword follows `before` is `pub` or `pub(...)`.
fn is_public(before: &str) -> bool {
    let mut vis = before.trim_end();
    if vis.ends_with(')')
        && let Some(open) = vis.rfind('(')
    {
        vis = vis[..open].trim_end();
    }
    vis.strip_suffix("pub")
        .is_some_and(|head| !head.ends_with(is_ident))
}

/// Expands the use tree `tree` under `prefix` (a path ending in `::`, or empty).
fn expand_tree(prefix: &str, tree: &str, public: bool, out: &mut Vec<UsePath>) {
    for part in split_top_level(tree) {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        if let Some(open) = part.find('{') {
            let inner_end = part.rfind('}').unwrap_or(part.len());
            let head: String = part[..open].split_whitespace().collect();
            let inner = &part[open + 1..inner_end.max(open + 1)];
            expand_tree(&format!("{prefix}{head}"), inner, public, out);
            continue;
        }
        let mut words = part.split_whitespace();
        let path: String = words.next().unwrap_or_default().to_owned();
        let alias = match (words.next(), words.next()) {
            (Some("as"), Some(name)) => Some(name.to_owned()),
            _ => None,
        };
        let full = format!("{prefix}{path}");
        let mut segments: Vec<String> = full
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if segments.len() > 1 && segments.last().is_some_and(|s| s == "self") {
            segments.pop();
        }
        let name = alias.unwrap_or_else(|| segments.last().cloned().unwrap_or_default());
        out.push(UsePath {
            segments,
            name,
            public,
        });
    }
}

/// `text` split at the commas outside braces.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// Every path in `code` that starts with `crate`, `super` or `self` and goes on with
/// `::name` (`crate::mr::Mr`, `super::super::x`), as segments.
pub fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        let word_start = i == 0 || {
            let p = bytes[i - 1];
            !(p.is_ascii_alphanumeric() || p == b'_' || p == b':' || p >= 0x80)
        };
        let head = ["crate", "super", "self"]
            .into_iter()
            .find(|h| word_start && code[i..].starts_with(h));
        let Some(head) = head else {
            i += 1;
            continue;
        };
        let mut segments = vec![head.to_owned()];
        let mut j = i + head.len();
        while code[j..].starts_with("::") {
            let name_len = code[j + 2..]
                .find(|c: char| !is_ident(c))
                .unwrap_or(code.len() - j - 2);
            if name_len == 0 {
                break;
            }
            segments.push(code[j + 2..j + 2 + name_len].to_owned());
            j += 2 + name_len;
        }
        if segments.len() > 1 {
            paths.push(segments);
        }
        i = j.max(i + 1);
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_literals_are_dropped() {
        let text = "a // crate::x\n/* crate::y /* nested */ */ b \"crate::z\" 'c' '\\'' \
                    r#\"crate::w\"# &'a T";
        assert_eq!(code_only(text), "a \n  b \"\" '' '' \"\" &'a T");
    }

    #[test]
    fn test_modules_and_declarations_are_dropped() {
        let code = "x\n#[cfg(test)]\nmod tests { use crate::a; { } }\ny\n\
                    #[cfg(test)]\n#[path = \"t.rs\"]\npub(crate) mod more;\nz\n\
                    #[cfg(test)]\nfn helper() {}\n";
        let (kept, declared) = without_test_modules(code);
        assert_eq!(kept, "x\n\ny\n\nz\n#[cfg(test)]\nfn helper() {}\n");
        assert_eq!(declared, ["more"]);
    }

    #[test]
    fn grouped_trees_expand() {
        let paths = use_paths("pub use crate::{a::{B, C as D}, e::{self}, f};\nuse std::x;");
        let shown: Vec<(String, String, bool)> = paths
            .iter()
            .map(|p| (p.segments.join("::"), p.name.clone(), p.public))
            .collect();
        let want = [
            ("crate::a::B", "B"),
            ("crate::a::C", "D"),
            ("crate::e", "e"),
            ("crate::f", "f"),
        ];
        for (i, (path, name)) in want.iter().enumerate() {
            assert_eq!(shown[i], (path.to_string(), name.to_string(), true));
        }
        assert_eq!(shown[4], ("std::x".into(), "x".into(), false));
        assert_eq!(shown.len(), 5);
    }

    #[test]
    fn restricted_visibility_is_public_and_reuse_is_no_use() {
        let paths = use_paths("pub(crate) use super::x;\nfn reuse() {}\n let used = 1;");
        assert_eq!(paths.len(), 1);
        assert!(paths[0].public);
        assert_eq!(paths[0].segments, ["super", "x"]);
    }

    #[test]
    fn inline_paths_are_found() {
        let code =
            "let x = crate::cq::Cq::new(); super::super::f(); self.y; $crate::m::M; a::self::b";
        let found: Vec<String> = inline_paths(code).iter().map(|p| p.join("::")).collect();
        assert_eq!(
            found,
            ["crate::cq::Cq::new", "super::super::f", "crate::m::M"]
        );
    }
}
