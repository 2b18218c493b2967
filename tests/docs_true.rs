//! The README and the documents under docs/ name files, tests, functions, types, commands and
//! settings as evidence and as instructions ("kept by", "proved by", "run `trailmark ...`",
//! "set `worker.lease_secs`"). These tests keep every such name pointing at something that
//! exists, so a renamed file, test, function, subcommand or setting cannot leave a document
//! citing nothing, and a code block marked as a copy of a file stays that file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Names the documents use that the workspace does not define, each with why. Keep it short:
/// an entry is either another system's name or a real setting the defaults file lacks.
const ALLOWED: &[(&str, &str)] = &[
    // A real setting (`ModelSettings::fallback_model` in src/model/mod.rs, accepted by the
    // loader) that config/default.toml does not list yet; remove once the file lists it.
    ("model.fallback_model", "missing from config/default.toml"),
    // Postgres's clock function, named where the bench stamps rows with it.
    ("now()", "a Postgres function"),
    // The HTTP header that carries an API token.
    ("Authorization", "an HTTP header"),
];

fn read(doc: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"))
}

/// README.md and every docs/*.md, as paths relative to the repository.
fn documents() -> Vec<String> {
    let mut docs = vec!["README.md".to_owned()];
    let mut more: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("docs"))
        .expect("docs/")
        .map(|e| {
            e.expect("docs/ entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// The text outside fenced code blocks (fenced lines become empty, so line numbers stay).
fn prose(text: &str) -> String {
    let mut fenced = false;
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The inline code spans of a document's prose, each with the text between it and the span
/// before it. `\|` (a pipe inside a table cell) reads as `|`.
fn spans(text: &str) -> Vec<(String, String)> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut gap = String::new();
    for (i, part) in prose.split('`').enumerate() {
        if i % 2 == 0 {
            gap = part.to_owned();
        } else {
            out.push((std::mem::take(&mut gap), part.replace("\\|", "|")));
        }
    }
    out
}

/// Every span that names a file under one of the repository's folders.
fn paths(text: &str) -> Vec<String> {
    let folders = [
        "src/",
        "tests/",
        "crates/",
        "examples/",
        "migrations/",
        "deploy/",
        "docs/",
        "config/",
        "scripts/",
        ".ci/",
    ];
    spans(text)
        .into_iter()
        .map(|(_, s)| s)
        .filter(|s| folders.iter().any(|f| s.starts_with(f)))
        .filter(|s| !s.contains(['*', '<', ' ']))
        .collect()
}

#[test]
fn every_file_the_documents_cite_exists() {
    let mut missing = Vec::new();
    for doc in documents() {
        for p in paths(&read(&doc)) {
            if !Path::new(ROOT).join(&p).exists() {
                missing.push(format!("{doc}: {p}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the documents cite files that do not exist: {missing:#?}"
    );
}

/// Every `<!-- example: PATH -->` block (the marker at the start of a line) is a copy of PATH:
/// the code fence between the marker and `<!-- /example -->` holds the file's text exactly (a
/// trailing newline aside).
#[test]
fn every_example_block_equals_the_file_it_names() {
    let mut wrong = Vec::new();
    let mut blocks = 0;
    for doc in documents() {
        let text = read(&doc);
        let mut rest = text.as_str();
        while let Some(at) = rest.find("\n<!-- example: ") {
            blocks += 1;
            let after = &rest[at + "\n<!-- example: ".len()..];
            let path = after[..after.find("-->").expect("an example marker ends with -->")]
                .trim()
                .to_owned();
            let end = after
                .find("<!-- /example -->")
                .unwrap_or_else(|| panic!("{doc}: the example of {path} has no <!-- /example -->"));
            let block = &after[..end];
            let open = block
                .find("```")
                .unwrap_or_else(|| panic!("{doc}: the example of {path} has no code fence"));
            let body_start = open + block[open..].find('\n').expect("a fence line ends") + 1;
            let body_end = block.rfind("```").expect("a closing fence");
            let shown = &block[body_start..body_end.max(body_start)];
            match std::fs::read_to_string(Path::new(ROOT).join(&path)) {
                Err(e) => wrong.push(format!("{doc}: the example names {path}: {e}")),
                Ok(file) if file.trim_end_matches('\n') != shown.trim_end_matches('\n') => {
                    let line = file
                        .lines()
                        .zip(shown.lines())
                        .position(|(a, b)| a != b)
                        .unwrap_or_else(|| file.lines().count().min(shown.lines().count()));
                    wrong.push(format!(
                        "{doc}: the example block differs from {path} from line {}",
                        line + 1
                    ));
                }
                Ok(_) => {}
            }
            rest = &after[end..];
        }
    }
    assert!(blocks > 0, "the README shows no example file");
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A name cited right after a file ("`tests/crash.rs` `kill_9_mid_run_...`", "`src/worker/step.rs`
/// (`shadow_writes`)") is in that file: a test function for files under tests/, a name the
/// source file uses for the others. Names follow the file separated only by spaces, commas,
/// parentheses and "and".
#[test]
fn every_name_cited_beside_a_file_is_in_that_file() {
    let mut missing = Vec::new();
    for doc in documents() {
        let mut file: Option<(String, String)> = None;
        for (gap, span) in spans(&read(&doc)) {
            let joined = gap.replace(" and ", " ");
            let adjacent = joined
                .chars()
                .all(|c| c.is_whitespace() || ",()".contains(c));
            if !adjacent {
                file = None;
            }
            if span.ends_with(".rs")
                && !span.contains(['*', ' '])
                && ["src/", "tests/", "crates/", "examples/"]
                    .iter()
                    .any(|f| span.starts_with(f))
            {
                file = std::fs::read_to_string(Path::new(ROOT).join(&span))
                    .ok()
                    .map(|text| (span.clone(), text));
                continue;
            }
            let Some((path, source)) = &file else {
                continue;
            };
            if !is_path_of_identifiers(&span) {
                file = None;
                continue;
            }
            let name = span.rsplit("::").next().expect("a segment");
            let found = if path.starts_with("tests/") {
                // Only test names are cited after a test file.
                !name.contains('_') || source.contains(&format!("fn {name}("))
            } else {
                identifiers(source).any(|w| w == name)
            };
            if !found {
                missing.push(format!("{doc}: {path} has no `{span}`"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "names cited beside a file that the file does not have: {missing:#?}"
    );
}

#[test]
fn every_function_type_command_and_setting_the_documents_name_exists() {
    let code = Code::index();
    let mut wrong = Vec::new();
    let mut allowed_used = BTreeSet::new();
    for doc in documents() {
        for (_, span) in spans(&read(&doc)) {
            let span = span.trim();
            if ALLOWED.iter().any(|(name, _)| *name == span) {
                allowed_used.insert(span.to_owned());
                continue;
            }
            if let Err(why) = code.check(span) {
                wrong.push(format!("{doc}: `{span}`: {why}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the documents name what the code does not have ({} names): {wrong:#?}",
        wrong.len()
    );
    let stale: Vec<&str> = ALLOWED
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !allowed_used.contains(*name))
        .collect();
    assert!(
        stale.is_empty(),
        "ALLOWED lists names no document uses any more: {stale:?}"
    );
}

/// What the documents may name: definitions in the workspace's Rust code, the CLI's commands
/// and options, the settings, and the code's text (for named spots and environment variables).
#[derive(Default)]
struct Code {
    fns: BTreeSet<String>,
    types: BTreeSet<String>,
    variants: BTreeSet<String>,
    modules: BTreeSet<String>,
    consts: BTreeSet<String>,
    /// Public fields (`Config::program`).
    fields: BTreeSet<String>,
    /// Crates a path may start with that are not the workspace's: other systems' APIs.
    foreign_crates: BTreeSet<String>,
    /// Top-level subcommands, each with its subcommands.
    commands: BTreeMap<String, BTreeSet<String>>,
    options: BTreeSet<String>,
    settings: BTreeSet<String>,
    sections: BTreeSet<String>,
    /// Every Rust source, script and deployment file, for names that are strings in the code.
    text: String,
}

impl Code {
    fn index() -> Self {
        let mut code = Code::default();
        let mut sources = Vec::new();
        for dir in ["src", "crates", "examples", "tests", "build.rs"] {
            files(&Path::new(ROOT).join(dir), &mut sources);
        }
        for file in &sources {
            let rel = file.strip_prefix(ROOT).expect("under the root");
            for part in rel.iter().map(|p| p.to_string_lossy()) {
                let stem = part.trim_end_matches(".rs");
                if is_identifier(stem) {
                    code.modules.insert(stem.to_owned());
                }
            }
            if file.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(file).expect("a source file");
                code.definitions(&text);
                code.text.push_str(&text);
            } else if file.file_name().is_some_and(|n| n == "Cargo.toml") {
                let toml = std::fs::read_to_string(file).expect("a manifest");
                if let Some(name) = toml_value(&toml, "name") {
                    code.modules.insert(name.replace('-', "_"));
                }
            }
        }
        let mut other = Vec::new();
        for dir in ["scripts", "deploy", "Containerfile", ".ci"] {
            files(&Path::new(ROOT).join(dir), &mut other);
        }
        for file in other {
            if let Ok(text) = std::fs::read_to_string(file) {
                code.text.push_str(&text);
            }
        }
        code.modules
            .extend(["trailmark", "crate", "self", "super"].map(str::to_owned));
        let root = read("Cargo.toml");
        let deps = root
            .split("[workspace.dependencies]")
            .nth(1)
            .expect("workspace dependencies")
            .split("\n[")
            .next()
            .expect("a table");
        code.foreign_crates = deps
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, _)| k.trim().replace('-', "_")))
            .filter(|k| !k.is_empty() && !k.starts_with('#') && !k.starts_with("trailmark"))
            .chain(["std", "core", "alloc"].map(str::to_owned))
            .collect();
        code.cli();
        code.config();
        code
    }

    /// Records the definitions of one Rust source: `fn`, `struct`, `enum`, `trait`, `type`,
    /// `mod`, `const`, `static`, `macro_rules!`, and lines that read as enum variants.
    fn definitions(&mut self, text: &str) {
        let mut previous = "";
        for word in identifiers(text) {
            match previous {
                "fn" => self.fns.insert(word.to_owned()),
                "struct" | "enum" | "trait" | "type" | "union" => {
                    self.types.insert(word.to_owned())
                }
                "mod" => self.modules.insert(word.to_owned()),
                "const" | "static" => self.consts.insert(word.to_owned()),
                "macro_rules" => self.fns.insert(word.to_owned()),
                _ => false,
            };
            previous = word;
        }
        for line in text.lines() {
            let line = line.trim_start();
            if let Some(field) = line.strip_prefix("pub ")
                && let Some((name, _)) = field.split_once(':')
                && is_identifier(name)
            {
                self.fields.insert(name.to_owned());
            }
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.starts_with(|c: char| c.is_ascii_uppercase()) {
                let after = line[name.len()..].trim_start();
                if after.is_empty() || after.starts_with([',', '(', '{', '=']) {
                    self.variants.insert(name);
                }
            }
        }
    }

    /// The `trailmark` binary's subcommands and long options, read from its clap definitions.
    fn cli(&mut self) {
        let mut sources = Vec::new();
        files(&Path::new(ROOT).join("crates/cli/src"), &mut sources);
        let texts: Vec<String> = sources
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "rs"))
            .map(|f| std::fs::read_to_string(f).expect("a CLI source"))
            .collect();
        let all = texts.join("\n");
        for text in &texts {
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let attr = line.trim();
                if !(attr.starts_with("#[arg(") && attr.contains("long")) {
                    continue;
                }
                if let Some(named) = attr.split("long = \"").nth(1) {
                    self.options
                        .insert(named.split('"').next().expect("a name").to_owned());
                    continue;
                }
                let field = lines[i + 1..]
                    .iter()
                    .map(|l| l.trim())
                    .find(|l| !l.starts_with("#[") && !l.starts_with("//"))
                    .unwrap_or_default();
                let field = field.trim_start_matches("pub ");
                if let Some((name, _)) = field.split_once(':') {
                    self.options.insert(name.trim().replace('_', "-"));
                }
            }
        }
        self.options.extend(["help", "version"].map(str::to_owned));
        let main = read("crates/cli/src/main.rs");
        for (name, block) in variants_of(&main, "Command") {
            let children = block
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.ends_with("Command") || w.ends_with("Args"))
                .flat_map(|w| subcommands_of(&all, w))
                .collect();
            self.commands.insert(kebab(&name), children);
        }
        assert!(
            self.commands.contains_key("run") && !self.commands["run"].is_empty(),
            "the CLI's commands were not found in crates/cli/src/main.rs"
        );
    }

    /// The settings: every `section.key` of config/default.toml.
    fn config(&mut self) {
        let mut section = String::new();
        for line in read("config/default.toml").lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_owned();
                self.sections.insert(section.clone());
            } else if let Some((key, _)) = line.split_once('=')
                && !line.starts_with('#')
            {
                self.settings.insert(format!("{section}.{}", key.trim()));
            }
        }
    }

    /// Checks one inline code span; spans that are none of the classes below pass.
    fn check(&self, span: &str) -> Result<(), String> {
        let span = span.trim_start_matches("$ ");
        // A file at the repository's root (`Containerfile`).
        if !span.is_empty() && !span.contains(' ') && Path::new(ROOT).join(span).exists() {
            return Ok(());
        }
        let mut words = span.split_whitespace().peekable();
        // Leading `NAME=value` words are environment variables, then maybe a command.
        let mut env_only = true;
        while let Some(word) = words.peek() {
            match word.split_once('=') {
                Some((name, _)) if is_env_name(name) => {
                    self.check_env(name)?;
                    words.next();
                }
                _ => {
                    env_only = false;
                    break;
                }
            }
        }
        if env_only && span.contains('=') {
            return Ok(());
        }
        let rest: Vec<&str> = words.collect();
        if let Some(first) = rest.first()
            && (*first == "trailmark" || first.ends_with("/trailmark"))
        {
            return self.check_command(&rest[1..]);
        }
        if span.contains(char::is_whitespace) {
            return self.check_rust(span);
        }
        if is_env_name(span) {
            return self.check_env(span);
        }
        if let Some((section, key)) = span.split_once('.')
            && self.sections.contains(section)
            && key
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_*".contains(c))
        {
            return self.check_setting(span);
        }
        self.check_rust(span)
    }

    fn check_setting(&self, key: &str) -> Result<(), String> {
        if self.settings.iter().any(|s| glob(key, s)) {
            return Ok(());
        }
        // A named spot in the code (a failpoint or a seam) reads like a setting.
        if self.text.contains(&format!("\"{key}\"")) {
            return Ok(());
        }
        Err("no such setting in config/default.toml (nor a named spot in the code)".into())
    }

    fn check_env(&self, name: &str) -> Result<(), String> {
        if name.contains('<') {
            return Ok(());
        }
        if let Some(key) = name.strip_prefix("TRAILMARK__") {
            let key = key.to_ascii_lowercase().replacen("__", ".", 1);
            return self
                .check_setting(&key)
                .map_err(|_| format!("maps to {key}, which config/default.toml does not have"));
        }
        if name.starts_with("TRAILMARK_") && !self.text.contains(name) {
            return Err("no code, script or deployment file reads this variable".into());
        }
        Ok(())
    }

    /// `trailmark SUB [CHILD | / CHILD ...] [--option ...]`.
    fn check_command(&self, words: &[&str]) -> Result<(), String> {
        let plain = |w: &str| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c == '-' || c.is_ascii_digit())
                && !w.starts_with('-')
        };
        let Some(first) = words.first() else {
            return Ok(());
        };
        if !plain(first) {
            return Ok(());
        }
        let Some(children) = self.commands.get(*first) else {
            return Err(format!("`trailmark {first}` is not a subcommand"));
        };
        let mut expect_child = !children.is_empty();
        for word in &words[1..] {
            if *word == "/" {
                expect_child = true;
            } else if expect_child && plain(word) {
                if !children.contains(*word) {
                    return Err(format!("`trailmark {first} {word}` is not a subcommand"));
                }
                expect_child = false;
            } else {
                expect_child = false;
            }
            let option = word.trim_start_matches('[');
            if let Some(option) = option.strip_prefix("--") {
                let option: String = option
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                if !option.is_empty() && !self.options.contains(&option) {
                    return Err(format!("no subcommand has the option --{option}"));
                }
            }
        }
        Ok(())
    }

    /// A span that reads as Rust: `use a::b::*;`, a path `a::B::c`, a call `name(...)`,
    /// `ctx.method(...)` or `.method()`, or a type name `CamelCase`. Anything else passes.
    fn check_rust(&self, span: &str) -> Result<(), String> {
        if let Some(path) = span.strip_prefix("use ") {
            let path = path.trim_end_matches(';').trim_end_matches("::*");
            return self.check_path(path);
        }
        let span = span.trim_end_matches(['?', ';']);
        let (head, args) = match span.find('(') {
            Some(at) if span.ends_with(')') => (&span[..at], Some(&span[at + 1..span.len() - 1])),
            _ => (span, None),
        };
        if head.contains('<') && !head.contains("::<") {
            // `<prefix>.events`: a name with a placeholder, not Rust.
            return Ok(());
        }
        let head = strip_generics(head);
        let head = head.trim_start_matches('&');
        if head.is_empty()
            || !head
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_:.".contains(c))
        {
            return Ok(());
        }
        if let Some(method) = head.strip_prefix('.') {
            // `.retryable()`, `.step(...)`: a method.
            if !is_identifier(method) {
                return Ok(());
            }
            self.check_fn(method)?;
        } else if head.contains('.') {
            // `ctx.model(...)`, `handle.start_run(...)`, `ctx.local_write`: a method on a value;
            // other dotted names (`run.id`, `basic.get`, SQL names) are not Rust.
            let (receiver, method) = head.rsplit_once('.').expect("a dot");
            if (args.is_some() || receiver == "ctx") && is_identifier(method) {
                self.check_fn(method)?;
            } else {
                return Ok(());
            }
        } else if head.contains("::") {
            self.check_path(head)?;
        } else if args.is_some() && is_identifier(head) {
            if head.starts_with(|c: char| c.is_ascii_uppercase()) {
                self.check_type(head)?;
            } else {
                self.check_fn(head)?;
            }
        } else if is_camel_case(head) {
            self.check_type(head)?;
        } else {
            return Ok(());
        }
        // Paths and type names inside the arguments: `ctx.model(&ChatRequest)`.
        if let Some(args) = args {
            let args = without_strings(args);
            for token in args.split(|c: char| !(c.is_ascii_alphanumeric() || "_:".contains(c))) {
                let token = token.trim_matches(':');
                if token.contains("::") {
                    self.check_path(token)?;
                } else if is_camel_case(token) {
                    self.check_type(token)?;
                }
            }
        }
        Ok(())
    }

    fn check_path(&self, path: &str) -> Result<(), String> {
        let path = strip_generics(path);
        let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        let Some(first) = segments.first() else {
            return Ok(());
        };
        if self.foreign_crates.contains(*first) {
            return Ok(());
        }
        for (i, segment) in segments.iter().enumerate() {
            let last = i + 1 == segments.len();
            if !is_identifier(segment) {
                return Ok(());
            }
            if segment.starts_with(|c: char| c.is_ascii_uppercase()) {
                if !last && !self.types.contains(*segment) {
                    // `Type::item`: an enum variant has no items of its own.
                    return Err(format!("no struct, enum, trait or type `{segment}`"));
                }
                if segment.chars().all(|c| !c.is_ascii_lowercase()) {
                    if !self.consts.contains(*segment) && !self.variants.contains(*segment) {
                        return Err(format!("no const, static or variant `{segment}`"));
                    }
                } else {
                    self.check_type(segment)?;
                }
            } else if !(self.modules.contains(*segment)
                || (last
                    && (self.fns.contains(*segment)
                        || self.consts.contains(*segment)
                        || self.fields.contains(*segment))))
            {
                return Err(if last {
                    format!("no fn or module `{segment}`")
                } else {
                    format!("no module or crate `{segment}`")
                });
            }
        }
        Ok(())
    }

    fn check_fn(&self, name: &str) -> Result<(), String> {
        if self.fns.contains(name) {
            Ok(())
        } else {
            Err(format!("no fn `{name}`"))
        }
    }

    fn check_type(&self, name: &str) -> Result<(), String> {
        if self.types.contains(name) || self.variants.contains(name) {
            Ok(())
        } else {
            Err(format!("no struct, enum, trait, type or variant `{name}`"))
        }
    }
}

/// Every file under `path` (or `path` itself), skipping build output.
fn files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_file() {
        out.push(path.to_owned());
        return;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return;
    };
    for entry in entries.flatten() {
        let p = entry.path();
        if p.file_name()
            .is_some_and(|n| n == "target" || n == "fuzz-corpus")
        {
            continue;
        }
        files(&p, out);
    }
}

/// The identifiers of a text, in order.
fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| is_identifier(w))
}

fn is_identifier(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn is_path_of_identifiers(s: &str) -> bool {
    s.split("::").all(is_identifier)
}

/// `StepKind`, `Input`: a capital, then at least one lower-case letter, no separators.
fn is_camel_case(s: &str) -> bool {
    s.len() > 1
        && s.starts_with(|c: char| c.is_ascii_uppercase())
        && s.chars().any(|c| c.is_ascii_lowercase())
        && s.chars().all(|c| c.is_ascii_alphanumeric())
}

fn is_env_name(s: &str) -> bool {
    s.starts_with("TRAILMARK_")
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || "_<>".contains(c))
}

/// `a::<T>::b` -> `a::b`.
fn strip_generics(s: &str) -> String {
    let mut out = String::new();
    let mut depth = 0;
    for c in s.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.replace("::::", "::").trim_end_matches("::").to_owned()
}

fn without_strings(s: &str) -> String {
    s.split('"').step_by(2).collect::<Vec<_>>().join(" ")
}

/// Whether `pattern` (with `*` for any run of characters) matches `name`.
fn glob(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name.ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

fn kebab(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

fn toml_value(toml: &str, key: &str) -> Option<String> {
    toml.lines()
        .find(|l| l.trim_start().starts_with(&format!("{key} =")))
        .and_then(|l| l.split('"').nth(1))
        .map(str::to_owned)
}

/// The variants of `enum name` in `text` (four-space indented, as rustfmt writes them), each
/// with the text up to the next variant.
fn variants_of(text: &str, name: &str) -> Vec<(String, String)> {
    let Some(start) = text.find(&format!("enum {name} {{")) else {
        return Vec::new();
    };
    let body = &text[start..];
    let body = &body[..body.find("\n}").unwrap_or(body.len())];
    let mut out: Vec<(String, String)> = Vec::new();
    for line in body.lines().skip(1) {
        let is_variant = line.starts_with("    ")
            && !line.starts_with("     ")
            && line
                .trim_start()
                .starts_with(|c: char| c.is_ascii_uppercase());
        if is_variant {
            let variant: String = line
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            out.push((variant, line.to_owned()));
        } else if let Some((_, block)) = out.last_mut() {
            block.push('\n');
            block.push_str(line);
        }
    }
    out
}

/// The subcommands a clap type brings: the variants of a `Subcommand` enum, or those of the
/// `#[command(subcommand)]` field of an `Args` struct.
fn subcommands_of(all: &str, type_name: &str) -> BTreeSet<String> {
    let variants = variants_of(all, type_name);
    if !variants.is_empty() {
        return variants.into_iter().map(|(v, _)| kebab(&v)).collect();
    }
    let Some(start) = all.find(&format!("struct {type_name} {{")) else {
        return BTreeSet::new();
    };
    let body = &all[start..];
    let body = &body[..body.find("\n}").unwrap_or(body.len())];
    let Some(at) = body.find("#[command(subcommand)]") else {
        return BTreeSet::new();
    };
    let field = body[at..].lines().nth(1).unwrap_or_default();
    field
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.ends_with("Command"))
        .flat_map(|w| subcommands_of(all, w))
        .collect()
}
