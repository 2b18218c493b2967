//! The architecture document and the README name files and tests as evidence ("kept by",
//! "proved by"); this keeps every such name pointing at something that exists, so a renamed
//! file or test cannot leave a promise citing nothing.

use std::path::Path;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(doc: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"))
}

/// Every `` `path` `` in `text` that starts with one of the repository's folders.
fn paths(text: &str) -> Vec<String> {
    let folders = [
        "src/",
        "tests/",
        "crates/",
        "migrations/",
        "deploy/",
        "docs/",
        "config/",
    ];
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| folders.iter().any(|f| s.starts_with(f)))
        .filter(|s| !s.contains(['*', '<', ' ']))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_file_the_documents_cite_exists() {
    for doc in ["docs/ARCHITECTURE.md", "README.md"] {
        let missing: Vec<String> = paths(&read(doc))
            .into_iter()
            .filter(|p| !Path::new(ROOT).join(p).exists())
            .collect();
        assert!(
            missing.is_empty(),
            "{doc} cites files that do not exist: {missing:?}"
        );
    }
}

/// Every "`tests/file.rs` `test_name`" in the architecture document names a test in that file.
#[test]
fn every_test_the_architecture_document_cites_exists() {
    let doc = read("docs/ARCHITECTURE.md");
    let mut missing = Vec::new();
    for cell in doc.split('|') {
        let mut file: Option<String> = None;
        for (i, part) in cell.split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            if part.starts_with("tests/") && part.ends_with(".rs") {
                file = Some(read(part));
            } else if let Some(source) = &file
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && part.contains('_')
                && !source.contains(&format!("fn {part}("))
            {
                missing.push(part.to_owned());
            }
        }
    }
    assert!(missing.is_empty(), "tests cited but not found: {missing:?}");
}
