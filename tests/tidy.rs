//! Repository rules checked as tests: a `//!` line opening every Rust file, a stated reason for every `unsafe`, and files short enough to hold one concept.
//!
//! The rules read every `.rs` file of the workspace except `target/` and dot folders. The
//! `unsafe` rules look at code only: comments and string literals are blanked first, so a
//! rule quoted in a doc or a test sample is not mistaken for code.

use std::path::{Path, PathBuf};

/// Above this many lines a file must say at its top why it is not split.
const MAX_LINES: usize = 800;

/// The phrase, in the opening `//!` block, that states why a file is longer than [`MAX_LINES`].
const LENGTH_REASON: &str = "longer than 800 lines because";

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every Rust file of the workspace with its text, paths relative to the workspace root.
fn workspace_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(
        files.len() > 10,
        "found only {} Rust files under {}",
        files.len(),
        root.display()
    );
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let shown = path.strip_prefix(&root).unwrap_or(&path);
            (shown.display().to_string(), text)
        })
        .collect()
}

/// `text` with every comment and the contents of every string and character literal replaced
/// by spaces; line breaks stay, so byte offsets and line numbers are those of `text`.
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = bytes.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for byte in &mut out[from..to] {
            if *byte != b'\n' {
                *byte = b' ';
            }
        }
    };
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"//") {
            let end = rest
                .iter()
                .position(|&b| b == b'\n')
                .map_or(bytes.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if rest.starts_with(b"/*") {
            // Block comments nest in Rust.
            let mut depth = 0usize;
            let mut j = i;
            while j < bytes.len() {
                if bytes[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if bytes[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if let Some((open, hashes)) = raw_string_start(bytes, i) {
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let body = i + open;
            let end = bytes[body..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(bytes.len(), |p| body + p);
            blank(&mut out, body, end);
            i = (end + close.len()).min(bytes.len());
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            let end = j.min(bytes.len());
            blank(&mut out, i + 1, end);
            i = end + 1;
        } else if bytes[i] == b'\'' {
            // A character literal (`'x'`, `'\n'`, `'\''`), or else a lifetime or label.
            let literal_end = if rest.get(1) == Some(&b'\\') {
                rest.iter()
                    .skip(3)
                    .position(|&b| b == b'\'')
                    .map(|p| i + 3 + p)
            } else {
                let width = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                (rest.get(1 + width) == Some(&b'\'')).then_some(i + 1 + width)
            };
            match literal_end {
                Some(end) => {
                    blank(&mut out, i + 1, end);
                    i = end + 1;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// At a raw string (`r"`, `r#"`, `br#"`...) that starts at `i`: the length of its opening and
/// its number of `#`s.
fn raw_string_start(bytes: &[u8], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_') {
        return None;
    }
    let mut j = i;
    if bytes.get(j) == Some(&b'b') || bytes.get(j) == Some(&b'c') {
        j += 1;
    }
    if bytes.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = bytes[j..].iter().take_while(|&&b| b == b'#').count();
    j += hashes;
    (bytes.get(j) == Some(&b'"')).then_some((j + 1 - i, hashes))
}

/// The words of `code` (identifiers and keywords) and single punctuation bytes, each with its
/// byte offset.
fn tokens(code: &str) -> Vec<(usize, &str)> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_whitespace() {
            i += 1;
        } else if b.is_ascii_alphanumeric() || b == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push((start, &code[start..i]));
        } else {
            let width = code[i..].chars().next().map_or(1, char::len_utf8);
            out.push((i, &code[i..i + width]));
            i += width;
        }
    }
    out
}

/// What an `unsafe` keyword introduces, as far as the rules care.
#[derive(Debug, PartialEq)]
enum UnsafeItem {
    /// `unsafe { ... }`, `unsafe impl` and `unsafe extern` blocks: need a `// SAFETY:` comment.
    Block(&'static str),
    /// `unsafe fn name` and `unsafe trait Name`: need a `# Safety` doc section.
    Declaration(&'static str),
}

/// Classifies the `unsafe` at token `index`; `None` for a function-pointer type
/// (`unsafe extern "C" fn(...)`) or the `#[unsafe(...)]` attribute, which state no obligation
/// of their own.
fn classify(tokens: &[(usize, &str)], index: usize) -> Option<UnsafeItem> {
    let next = |k: usize| tokens.get(index + k).map(|t| t.1);
    let mut k = 1;
    if next(k) == Some("extern") {
        k += 1;
        // The ABI string, blanked to `"   "`.
        if next(k) == Some("\"") {
            k += 1;
            while next(k).is_some_and(|t| t != "\"") {
                k += 1;
            }
            k += 1;
        }
        if next(k) == Some("{") {
            return Some(UnsafeItem::Block("unsafe extern block"));
        }
    }
    match next(k)? {
        "{" => Some(UnsafeItem::Block("unsafe block")),
        "impl" => Some(UnsafeItem::Block("unsafe impl")),
        "fn" if next(k + 1)
            .is_some_and(|t| t.starts_with(|c: char| c.is_alphabetic() || c == '_')) =>
        {
            Some(UnsafeItem::Declaration("unsafe fn"))
        }
        "trait" => Some(UnsafeItem::Declaration("unsafe trait")),
        _ => None,
    }
}

/// The comment and attribute lines directly above line `line` (0-based), nearest first; a
/// blank line or a line of code ends them.
fn lines_above<'a>(lines: &[&'a str], line: usize) -> impl Iterator<Item = &'a str> {
    lines[..line]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#[") || l.starts_with("#!["))
}

/// The places in `text` where an `unsafe` lacks its stated reason, as `line: problem`.
fn unsafe_problems(text: &str) -> Vec<String> {
    let code = code_only(text);
    let lines: Vec<&str> = text.lines().collect();
    let tokens = tokens(&code);
    let mut problems = Vec::new();
    for (index, &(offset, word)) in tokens.iter().enumerate() {
        if word != "unsafe" {
            continue;
        }
        let line = code[..offset].matches('\n').count();
        let missing = match classify(&tokens, index) {
            Some(UnsafeItem::Block(what)) => {
                let stated =
                    lines_above(&lines, line).any(|l| l.starts_with("//") && l.contains("SAFETY:"));
                (!stated).then(|| format!("{what} without a `// SAFETY:` comment directly above"))
            }
            Some(UnsafeItem::Declaration(what)) => {
                let documented = lines_above(&lines, line).any(|l| {
                    l.starts_with("///") && l.trim_start_matches('/').trim() == "# Safety"
                });
                (!documented).then(|| format!("{what} without a `# Safety` doc section"))
            }
            None => None,
        };
        if let Some(problem) = missing {
            problems.push(format!("{}: {problem}", line + 1));
        }
    }
    problems
}

/// Whether `text` is over [`MAX_LINES`] lines without saying why in its opening `//!` block.
fn length_problem(text: &str) -> Option<String> {
    let count = text.lines().count();
    if count <= MAX_LINES {
        return None;
    }
    let reasoned = text
        .lines()
        .map(str::trim_start)
        .take_while(|l| l.starts_with("//!") || l.starts_with("#!["))
        .any(|l| l.to_lowercase().contains(LENGTH_REASON));
    (!reasoned).then(|| {
        format!(
            "{count} lines, over {MAX_LINES}, and no `//! Longer than {MAX_LINES} lines because ...` at the top"
        )
    })
}

#[test]
fn every_rust_file_opens_with_a_module_doc_line() {
    let missing: Vec<String> = workspace_files()
        .into_iter()
        .filter(|(_, text)| !text.trim_start().starts_with("//!"))
        .map(|(path, _)| path)
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading `//!` line:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_unsafe_states_why_it_is_sound() {
    let problems: Vec<String> = workspace_files()
        .into_iter()
        .flat_map(|(path, text)| {
            unsafe_problems(&text)
                .into_iter()
                .map(move |problem| format!("{path}:{problem}"))
        })
        .collect();
    assert!(
        problems.is_empty(),
        "{} unsafe places without their reason:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn no_file_is_over_800_lines_without_a_reason() {
    let problems: Vec<String> = workspace_files()
        .into_iter()
        .filter_map(|(path, text)| length_problem(&text).map(|p| format!("{path}: {p}")))
        .collect();
    assert!(
        problems.is_empty(),
        "files to split by concept, or to give a reason at the top:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_unsafe_rule_flags_bare_unsafe_and_accepts_stated_reasons() {
    let bad = r#"//! A sample.
fn f(p: *const u8) -> u8 {
    unsafe { *p }
}

// A comment that is no reason.
unsafe impl Send for S {}

/// Reads it.
pub unsafe fn read(p: *const u8) -> u8 {
    // SAFETY: the caller's contract.
    unsafe { *p }
}

// SAFETY: a blank line breaks the link.

unsafe extern "C" {
    fn puts(s: *const u8) -> i32;
}
"#;
    assert_eq!(
        unsafe_problems(bad),
        [
            "3: unsafe block without a `// SAFETY:` comment directly above",
            "7: unsafe impl without a `// SAFETY:` comment directly above",
            "10: unsafe fn without a `# Safety` doc section",
            "17: unsafe extern block without a `// SAFETY:` comment directly above",
        ]
    );

    let good = r##"//! A sample.
fn f(p: *const u8) -> u8 {
    // SAFETY: `p` points into the live buffer checked above.
    let byte = unsafe { *p };
    byte
}

// SAFETY: `S` owns its pointer; nothing else aliases it.
#[allow(unused)]
unsafe impl Send for S {}

/// Reads it.
///
/// # Safety
///
/// `p` must be valid for a read.
#[inline]
pub unsafe fn read(p: *const u8) -> u8 {
    // SAFETY: the caller's contract.
    // (a second line of the same comment)
    unsafe { *p }
}

// A function-pointer type and the 2024 attribute state no obligation.
type Entry = unsafe extern "C" fn() -> *const u8;
#[unsafe(no_mangle)]
pub extern "C" fn entry() {}

// Quoted and commented `unsafe` is not code.
const RULE: &str = "unsafe { x }";
const RAW: &str = r#"unsafe impl Send"#;
/* unsafe { y } */
const QUOTE: char = '"';
fn g<'a>(s: &'a str) -> &'a str { s } // unsafe { z }
"##;
    assert_eq!(unsafe_problems(good), Vec::<String>::new());
}

#[test]
fn the_length_rule_counts_lines_and_reads_the_reason_at_the_top() {
    let body = "fn f() {}\n".repeat(MAX_LINES);
    let short = format!("//! A sample.\n{}", "fn f() {}\n".repeat(MAX_LINES - 1));
    assert_eq!(length_problem(&short), None);

    let long = format!("//! A sample.\n{body}");
    assert_eq!(
        length_problem(&long),
        Some(format!(
            "{} lines, over 800, and no `//! Longer than 800 lines because ...` at the top",
            MAX_LINES + 1
        ))
    );

    let reasoned = format!(
        "//! A sample.\n//!\n//! Longer than 800 lines because the table is one unit.\n{body}"
    );
    assert_eq!(length_problem(&reasoned), None);

    // A reason further down is not at the top.
    let buried = format!("//! A sample.\n{body}// Longer than 800 lines because of this.\n");
    assert!(length_problem(&buried).is_some());
}
