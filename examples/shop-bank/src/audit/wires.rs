//! The wires to the other bank (scenario 8): each reached the bank once, none was lost half
//! way, and every answer a client accepted is what the books and the bank say.

use std::collections::HashMap;

use idem_guard::Scalar;

use super::Findings;
use crate::chaos::Ack;
use crate::db::{int, text};

/// The shop's wires, as [`check`] reads them.
pub(super) const WIRE_COLUMNS: &str = "wire, from_account, amount, status, receipt";
/// The other bank's books, as [`check`] reads them.
pub(super) const BANK_COLUMNS: &str = "bank_key, reference, amount, receipt";

/// The account and amount of every wire that took money from its account.
pub(super) fn debited(wires: &[Vec<Scalar>]) -> Vec<(i64, i64)> {
    wires
        .iter()
        .filter(|r| matches!(text(r, 3).as_str(), "debited" | "sent"))
        .map(|r| (int(r, 1), int(r, 2)))
        .collect()
}

/// Holds the wires against the bank's books and the clients' answers.
pub(super) fn check(f: &mut Findings, wires: &[Vec<Scalar>], bank: &[Vec<Scalar>], acks: &[Ack]) {
    let wire_row: HashMap<String, &Vec<Scalar>> = wires.iter().map(|r| (text(r, 0), r)).collect();
    let mut at_bank: HashMap<String, Vec<&Vec<Scalar>>> = HashMap::new();
    for r in bank {
        at_bank.entry(text(r, 1)).or_default().push(r);
    }

    // The bank took each wire once, and only wires the shop debited, for what it debited.
    let mut found = Vec::new();
    for (wire, taken) in &at_bank {
        if taken.len() > 1 {
            found.push(format!(
                "wire {wire} reached the other bank {} times",
                taken.len()
            ));
        }
        let debited = wire_row
            .get(wire)
            .filter(|w| matches!(text(w, 3).as_str(), "debited" | "sent"));
        match debited {
            None => found.push(format!(
                "the other bank took wire {wire}, which the shop never debited"
            )),
            Some(w) if taken.iter().any(|b| int(b, 2) != int(w, 2)) => found.push(format!(
                "the other bank took wire {wire} for another amount than the shop debited ({})",
                int(w, 2)
            )),
            Some(_) => {}
        }
    }
    f.check("each wire reaches the bank once", bank.len(), found);

    // Every debited wire went through to the end: no money left the account without reaching
    // the bank, and the shop's row holds the bank's receipt.
    let found = wires
        .iter()
        .filter_map(|w| {
            let (wire, status) = (text(w, 0), text(w, 3));
            let receipts: Vec<String> = at_bank
                .get(&wire)
                .map(|t| t.iter().map(|b| text(b, 3)).collect())
                .unwrap_or_default();
            match status.as_str() {
                "debited" => Some(format!(
                    "wire {wire} was debited and never finished (the bank holds {} of it)",
                    receipts.len()
                )),
                "sent" if !receipts.contains(&text(w, 4)) => Some(format!(
                    "wire {wire} is marked sent with receipt {}; the bank holds {receipts:?}",
                    text(w, 4)
                )),
                _ => None,
            }
        })
        .collect();
    f.check("no wire lost half way", wires.len(), found);

    let answers = acks.iter().filter_map(|a| match a {
        Ack::Wire {
            wire,
            outcome,
            amount,
        } => Some((wire, outcome, *amount)),
        _ => None,
    });
    f.check_answers(
        "wire answers match the books",
        answers,
        |(wire, outcome, amount)| {
            let row = wire_row.get(*wire);
            let books = row.map(|w| (text(w, 3), int(w, 2)));
            (books.as_ref() != Some(&((*outcome).clone(), *amount))).then(|| {
                format!("wire {wire} was answered {outcome} for {amount}; the books say {books:?}")
            })
        },
    );
}
