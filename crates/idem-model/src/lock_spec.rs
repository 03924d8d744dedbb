//! The lock operations of a [`LockStore`](idem_core::LockStore) as a sequential specification,
//! for stateright's [`LinearizabilityTester`](stateright::semantics::LinearizabilityTester).
//!
//! Leases here never run out: the backends decide expiry by their own clock, which a history
//! does not record, so the test that uses this gives every holding a lease far longer than
//! its run (the lock conformance suite and the fault harness cover leases that end). What is
//! left is exact: one holder at a time, a repeated acquire by the holder keeps its fence, a
//! new holding gets a fence above every fence before it for the name, and renewals and
//! releases are the holder's alone, a release repeatable by the last owner.
//!
//! The one answer the specification does not decide is a new holding's fence: a backend draws
//! it (from its clock, a counter, a transaction id). [`LockSpec`] takes the fence an acquire
//! answered with and checks that it is above every earlier one.

use stateright::semantics::SequentialSpec;

/// A call on a backend's locks; names and owners are small numbers of the test's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockOp {
    /// `acquire(name, owner)`.
    Acquire {
        /// The lock.
        name: u8,
        /// Who asks.
        owner: u8,
    },
    /// `renew(name, owner, fence)`.
    Renew {
        /// The lock.
        name: u8,
        /// Who asks.
        owner: u8,
        /// The holding's fence it names.
        fence: u64,
    },
    /// `release(name, owner, fence)`.
    Release {
        /// The lock.
        name: u8,
        /// Who asks.
        owner: u8,
        /// The holding's fence it names.
        fence: u64,
    },
}

/// What a call answered. A backend's failure (whose effect is unknown) is no answer: such a
/// call stays in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockRet {
    /// The caller holds the lock with this fence.
    Acquired(u64),
    /// Another owner holds it.
    Busy,
    /// A renewal or release went through.
    Ok,
    /// The caller does not hold the lock with that fence.
    NotOwner,
}

/// One lock's state: its last holding, and whether it is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holding {
    owner: u8,
    fence: u64,
    released: bool,
}

/// The locks, one state per name, changed one call at a time.
#[derive(Debug, Clone, Default)]
pub struct LockSpec {
    locks: Vec<(u8, Holding)>,
}

impl LockSpec {
    /// No lock ever held.
    pub fn new() -> Self {
        Self::default()
    }

    fn holding(&mut self, name: u8) -> Option<&mut Holding> {
        self.locks
            .iter_mut()
            .find(|(n, _)| *n == name)
            .map(|(_, h)| h)
    }

    /// Applies `op`, with `fence` as the fence a new holding gets; answers what a backend must.
    fn apply(&mut self, op: &LockOp, fence: u64) -> LockRet {
        match *op {
            LockOp::Acquire { name, owner } => match self.holding(name) {
                Some(h) if !h.released && h.owner == owner => LockRet::Acquired(h.fence),
                Some(h) if !h.released => LockRet::Busy,
                Some(h) => {
                    *h = Holding {
                        owner,
                        fence,
                        released: false,
                    };
                    LockRet::Acquired(fence)
                }
                None => {
                    self.locks.push((
                        name,
                        Holding {
                            owner,
                            fence,
                            released: false,
                        },
                    ));
                    LockRet::Acquired(fence)
                }
            },
            LockOp::Renew { name, owner, fence } => match self.holding(name) {
                Some(h) if !h.released && h.owner == owner && h.fence == fence => LockRet::Ok,
                _ => LockRet::NotOwner,
            },
            LockOp::Release { name, owner, fence } => match self.holding(name) {
                Some(h) if h.owner == owner && h.fence == fence => {
                    h.released = true;
                    LockRet::Ok
                }
                _ => LockRet::NotOwner,
            },
        }
    }

    /// The fence a new holding of `name` must be above.
    fn last_fence(&self, name: u8) -> u64 {
        self.locks
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, h)| h.fence)
    }
}

impl SequentialSpec for LockSpec {
    type Op = LockOp;
    type Ret = LockRet;

    /// The answer `op` gets; a new holding's fence is one above the last (it is never
    /// compared: see [`Self::is_valid_step`]).
    fn invoke(&mut self, op: &LockOp) -> LockRet {
        let next = match op {
            LockOp::Acquire { name, .. } => self.last_fence(*name) + 1,
            _ => 0,
        };
        self.apply(op, next)
    }

    /// Whether `op` may answer `ret`: as [`Self::invoke`], but a new holding may have any
    /// fence above every earlier fence of its name.
    fn is_valid_step(&mut self, op: &LockOp, ret: &LockRet) -> bool {
        let fence = match (op, ret) {
            (LockOp::Acquire { name, .. }, LockRet::Acquired(fence)) => {
                let repeated = self.clone().apply(op, 0) == LockRet::Acquired(*fence);
                if !repeated && *fence <= self.last_fence(*name) {
                    return false;
                }
                *fence
            }
            _ => 0,
        };
        &self.apply(op, fence) == ret
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_specification_answers_as_a_lock_does() {
        let mut s = LockSpec::new();
        let a = LockOp::Acquire { name: 1, owner: 1 };
        assert!(s.is_valid_step(&a, &LockRet::Acquired(10)));
        // The holder again: the same fence, not a new one.
        assert!(!s.clone().is_valid_step(&a, &LockRet::Acquired(11)));
        assert!(s.is_valid_step(&a, &LockRet::Acquired(10)));
        let b = LockOp::Acquire { name: 1, owner: 2 };
        assert!(!s.clone().is_valid_step(&b, &LockRet::Acquired(11)));
        assert!(s.is_valid_step(&b, &LockRet::Busy));
        let renew = |owner, fence| LockOp::Renew {
            name: 1,
            owner,
            fence,
        };
        let release = |owner, fence| LockOp::Release {
            name: 1,
            owner,
            fence,
        };
        assert!(s.is_valid_step(&renew(2, 10), &LockRet::NotOwner));
        assert!(s.is_valid_step(&renew(1, 9), &LockRet::NotOwner));
        assert!(s.is_valid_step(&renew(1, 10), &LockRet::Ok));
        assert!(s.is_valid_step(&release(1, 10), &LockRet::Ok));
        assert!(s.is_valid_step(&release(1, 10), &LockRet::Ok), "repeatable");
        assert!(s.is_valid_step(&renew(1, 10), &LockRet::NotOwner));
        // After a release: a fence at or below the last is refused, a higher one taken.
        assert!(!s.clone().is_valid_step(&b, &LockRet::Acquired(10)));
        assert!(s.is_valid_step(&b, &LockRet::Acquired(25)));
        assert!(s.is_valid_step(&release(1, 10), &LockRet::NotOwner));
        // Names are apart.
        let other = LockOp::Acquire { name: 2, owner: 1 };
        assert!(s.is_valid_step(&other, &LockRet::Acquired(1)));
    }
}
