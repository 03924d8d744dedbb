//! The README's "Problem codes" table and the catalogue (`ProblemCode`) list the same codes,
//! with the same status and meaning.

use std::collections::BTreeSet;

use idem_http::ProblemCode;

const README: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));

/// `(status, code, meaning)` for each row of the README's table.
fn readme_rows() -> BTreeSet<(u16, String, String)> {
    let section = README
        .split("\n## Problem codes\n")
        .nth(1)
        .expect("README.md has a \"## Problem codes\" section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|l| l.starts_with("| "))
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            let [status, code, meaning] = cells[..] else {
                panic!("a row of three cells: {l}");
            };
            let status = status.parse().ok()?; // the header row
            let code = code.strip_prefix('`')?.strip_suffix('`')?;
            Some((status, code.to_owned(), meaning.to_owned()))
        })
        .collect()
}

#[test]
fn the_readme_lists_every_code_of_the_catalogue_and_no_other() {
    let catalogue: BTreeSet<(u16, String, String)> = ProblemCode::ALL
        .iter()
        .map(|c| {
            (
                c.status().as_u16(),
                c.as_str().to_owned(),
                c.meaning().to_owned(),
            )
        })
        .collect();
    let readme = readme_rows();
    let missing: Vec<_> = catalogue.difference(&readme).collect();
    let extra: Vec<_> = readme.difference(&catalogue).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "README.md's problem codes differ from ProblemCode.\nIn the catalogue, not the README: \
         {missing:#?}\nIn the README, not the catalogue: {extra:#?}"
    );
    assert_eq!(readme.len(), ProblemCode::ALL.len());
}
