//! The operator's view of a [`MemoryStore`]: listing, counting and fenced repairs.
//!
//! The records live in hash maps, which have no order to page by, so a page walks every shard
//! and keeps the `limit` smallest keys after the cursor (a bounded heap: memory for one page,
//! time for one pass over the records, which are in this process's memory and bounded by
//! [`MemoryLimits`](super::MemoryLimits)).

use std::collections::BinaryHeap;

use idem_core::admin::key_listing;
use idem_core::repair;
use idem_core::{
    BoxFuture, Counts, Cursor, Key, Listed, Page, Record, RecordAdmin, RecordFilter, RecordState,
    Repair, Shown, StoreError, Timestamp,
};

use super::{MemoryStore, lock, size};

impl RecordAdmin for MemoryStore {
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move { self.page(filter, after, limit, now) })
    }

    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>> {
        Box::pin(async move {
            let mut counts = Counts::default();
            for shard in &self.inner.shards {
                for record in lock(shard).values() {
                    if filter.matches_ignoring_state(record) {
                        counts.add(RecordState::of(record, now), record.created_at);
                    }
                }
            }
            Ok(counts)
        })
    }

    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut shard = self.shard(key);
            let still = |r: &&mut Box<Record>| repair::applies(repair, shown, r, now);
            let Some(record) = shard.get_mut(key).filter(still) else {
                return Ok(false);
            };
            match repair {
                Repair::Release => {
                    let before = size(record);
                    **record = Repair::released((**record).clone(), now);
                    self.changed(before, record);
                }
                Repair::Delete => {
                    let bytes = size(record);
                    shard.remove(key);
                    let mut u = self.usage_lock();
                    u.records = u.records.saturating_sub(1);
                    u.bytes = u.bytes.saturating_sub(bytes);
                }
            }
            Ok(true)
        })
    }
}

impl MemoryStore {
    /// One page of the records matching `filter` at `now`, after `after`.
    fn page(
        &self,
        filter: &RecordFilter,
        after: Option<&Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> Result<Page, StoreError> {
        let after = key_listing(filter, after, limit)?;
        // A max-heap of the smallest keys seen: its top is the largest of them.
        let mut page: BinaryHeap<ByKey> = BinaryHeap::with_capacity(limit + 1);
        for shard in &self.inner.shards {
            for (key, record) in lock(shard).iter() {
                if after.is_some_and(|a| key <= a) || !filter.matches(record, now) {
                    continue;
                }
                if page.len() == limit && page.peek().is_some_and(|top| &top.0.key <= key) {
                    continue;
                }
                page.push(ByKey(Listed::of(record, now)));
                if page.len() > limit {
                    page.pop();
                }
            }
        }
        let records: Vec<Listed> = page.into_sorted_vec().into_iter().map(|l| l.0).collect();
        Ok(Page::in_key_order(records, limit))
    }
}

/// A listed record ordered by its key alone.
struct ByKey(Listed);

impl PartialEq for ByKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.key == other.0.key
    }
}

impl Eq for ByKey {}

impl PartialOrd for ByKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.key.cmp(&other.0.key)
    }
}
