//! Runs the example as a user would, and reads what it printed: one transfer ran for three
//! sends of one key, a changed amount and a missing key were refused, and so was another
//! spelling of the method's path.

#![allow(clippy::unwrap_used)]

#[test]
fn a_retried_transfer_moves_money_once_and_other_spellings_are_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grpc-bank"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let answers: Vec<&str> = text.lines().filter(|l| l.starts_with("-> ")).collect();
    assert_eq!(
        answers[..3],
        ["-> t-1", "-> t-1 (replayed)", "-> t-1 (replayed)"],
        "{text}"
    );
    assert!(answers[3].starts_with("-> FailedPrecondition"), "{text}");
    assert!(answers[4].starts_with("-> InvalidArgument"), "{text}");
    assert!(
        answers[5].starts_with("-> InvalidArgument") && answers[5].contains("ambiguous_path"),
        "{text}"
    );
    assert_eq!(answers.len(), 6, "{text}");
    assert_eq!(
        text.matches("the bank moves").count(),
        1,
        "the transfer ran more than once: {text}"
    );
}
