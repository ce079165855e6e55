//! The in-memory store of responses made with `store: true`: bounded in bytes, each entry kept for one TTL, visible only to the key that made it.
//!
//! Every entry lives the same TTL, so insertion order is also expiry order: one queue gives
//! both the next to expire and the oldest to evict when the byte cap is reached. The store is
//! per process and lost on restart.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::api::auth::KeyOwner;

/// `--response-store-ttl` and `--response-store-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseStoreLimits {
    pub ttl: Duration,
    pub max_bytes: usize,
}

impl Default for ResponseStoreLimits {
    fn default() -> Self {
        ResponseStoreLimits {
            ttl: Duration::from_secs(3600),
            max_bytes: 64 << 20,
        }
    }
}

/// One stored response: what `GET` returns, and the conversation a follow-up continues.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object as it was returned.
    pub response: Value,
    /// Its input and output as chat messages, without its `instructions`.
    pub conversation: Vec<Value>,
}

impl StoredResponse {
    fn size(&self) -> usize {
        let conversation: usize = self.conversation.iter().map(json_len).sum();
        json_len(&self.response) + conversation
    }
}

fn json_len(value: &Value) -> usize {
    serde_json::to_vec(value).map_or(0, |v| v.len())
}

struct Entry {
    owner: KeyOwner,
    stored: StoredResponse,
    size: usize,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<String, Entry>,
    /// Ids in insertion order with their expiry; an id deleted early stays until popped.
    order: VecDeque<(String, Instant)>,
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, id: &str) -> Option<Entry> {
        let entry = self.entries.remove(id)?;
        self.bytes -= entry.size;
        Some(entry)
    }

    /// Drops what expired by `now`, then the oldest until `room` more bytes fit under `max`.
    fn make_room(&mut self, now: Instant, room: usize, max: usize) {
        while let Some((id, expires)) = self.order.front() {
            let expired = *expires <= now;
            let full = self.bytes + room > max;
            if !expired && !full {
                break;
            }
            let id = id.clone();
            self.order.pop_front();
            self.remove(&id);
        }
    }
}

/// Responses by id.
pub struct ResponseStore {
    limits: ResponseStoreLimits,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    pub fn new(limits: ResponseStoreLimits) -> ResponseStore {
        ResponseStore {
            limits,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves the maps consistent: each change is one call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `stored` under `id` (a fresh random id) for the TTL; one larger than the whole
    /// store is not kept.
    pub fn insert(&self, id: String, owner: KeyOwner, stored: StoredResponse) {
        let size = stored.size();
        if size > self.limits.max_bytes {
            tracing::warn!(
                size,
                "response {id} is larger than --response-store-size; not stored"
            );
            return;
        }
        let now = Instant::now();
        let mut inner = self.lock();
        inner.make_room(now, size, self.limits.max_bytes);
        inner.bytes += size;
        inner.order.push_back((id.clone(), now + self.limits.ttl));
        inner.entries.insert(
            id,
            Entry {
                owner,
                stored,
                size,
            },
        );
    }

    /// The response `id` if it is stored, not expired, and `owner` made it.
    pub fn get(&self, id: &str, owner: KeyOwner) -> Option<StoredResponse> {
        let mut inner = self.lock();
        inner.make_room(Instant::now(), 0, self.limits.max_bytes);
        let entry = inner.entries.get(id).filter(|e| e.owner == owner)?;
        Some(entry.stored.clone())
    }

    /// Removes the response `id` if `owner` made it; whether it was there.
    pub fn delete(&self, id: &str, owner: KeyOwner) -> bool {
        let mut inner = self.lock();
        inner.make_room(Instant::now(), 0, self.limits.max_bytes);
        if inner.entries.get(id).is_none_or(|e| e.owner != owner) {
            return false;
        }
        inner.remove(id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};
    use serde_json::json;

    fn stored(text: &str) -> StoredResponse {
        StoredResponse {
            response: json!({ "text": text }),
            conversation: vec![json!({"role": "user", "content": text})],
        }
    }

    fn owner(key: &'static str) -> KeyOwner {
        let mut headers = HeaderMap::new();
        headers.insert("x-api-key", HeaderValue::from_static(key));
        KeyOwner::of(&headers)
    }

    #[test]
    fn entries_are_seen_only_by_their_owner_and_can_be_deleted() {
        let store = ResponseStore::new(ResponseStoreLimits::default());
        store.insert("resp_1".into(), owner("a"), stored("one"));
        assert!(store.get("resp_1", owner("a")).is_some());
        assert!(store.get("resp_1", owner("b")).is_none());
        assert!(
            store
                .get("resp_1", KeyOwner::of(&HeaderMap::new()))
                .is_none()
        );
        assert!(!store.delete("resp_1", owner("b")));
        assert!(store.delete("resp_1", owner("a")));
        assert!(store.get("resp_1", owner("a")).is_none());
        assert!(!store.delete("resp_1", owner("a")));
    }

    #[test]
    fn the_byte_cap_evicts_the_oldest_and_the_ttl_expires_entries() {
        let one = stored("0123456789").size();
        let limits = ResponseStoreLimits {
            ttl: Duration::from_secs(3600),
            max_bytes: one * 2,
        };
        let store = ResponseStore::new(limits);
        for id in ["r1", "r2", "r3"] {
            store.insert(id.into(), owner("a"), stored("0123456789"));
        }
        assert!(store.get("r1", owner("a")).is_none());
        assert!(store.get("r2", owner("a")).is_some() && store.get("r3", owner("a")).is_some());
        store.insert("huge".into(), owner("a"), stored(&"x".repeat(one * 3)));
        assert!(store.get("huge", owner("a")).is_none());
        assert!(store.get("r3", owner("a")).is_some());

        let expiring = ResponseStore::new(ResponseStoreLimits {
            ttl: Duration::ZERO,
            max_bytes: 1 << 20,
        });
        expiring.insert("r".into(), owner("a"), stored("x"));
        assert!(expiring.get("r", owner("a")).is_none());
        assert_eq!(expiring.lock().bytes, 0);
    }
}
