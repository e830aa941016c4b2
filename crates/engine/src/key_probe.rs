//! Whether a key already holds an answer, asked for many keys in one read.
//!
//! Memory refuses a request without the database (a SKU or campaign found sold out, a
//! shopper found at the limit), but a key another instance answered, or this one
//! before a restart, holds its first answer in the database, and a retry must hear
//! that answer (DESIGN principle 4), not memory's "no". Looking each key up would
//! send every refused request of a flash sale's flood to the database after all; the
//! probe queues them instead, and one task reads a whole queue's keys with one
//! statement while the next requests queue up behind it: the combiner's adaptive
//! batching, for reads. A key found goes on to the database, which replays its
//! answer; a key not found is refused from memory as before.

use std::collections::HashSet;

use store::Store;
use tokio::sync::{mpsc, oneshot};

/// Keys one read asks about at most.
pub const KEYS_PER_PROBE_MAX: usize = 500;
/// Keys waiting for a read at most; beyond that a request is not refused from memory
/// (it goes to the database, whose own queue is bounded).
pub const KEYS_QUEUED_MAX: usize = 16_384;

struct Question {
    key: String,
    answer: oneshot::Sender<bool>,
}

pub(crate) struct KeyProbe {
    questions: mpsc::Sender<Question>,
}

impl KeyProbe {
    /// Starts the probe's task on the current runtime.
    pub(crate) fn start(store: Store) -> KeyProbe {
        let (questions, queue) = mpsc::channel(KEYS_QUEUED_MAX);
        tokio::spawn(answer_questions(store, queue));
        KeyProbe { questions }
    }

    /// Whether `key` holds a committed answer: `None` when that cannot be known now
    /// (the queue is full, the read failed), which a caller treats as "it may".
    pub(crate) async fn holds_answer(&self, key: &str) -> Option<bool> {
        let (answer, answered) = oneshot::channel();
        let question = Question {
            key: key.to_owned(),
            answer,
        };
        if self.questions.try_send(question).is_err() {
            metrics::counter!("stockd_key_probes_total", "result" => "queue_full").increment(1);
            return None;
        }
        answered.await.ok()
    }
}

/// The probe's task: each round takes every question queued (up to the bound) and
/// answers them all from one read. Ends when the engine is dropped.
async fn answer_questions(store: Store, mut queue: mpsc::Receiver<Question>) {
    let mut round = Vec::with_capacity(KEYS_PER_PROBE_MAX);
    while queue.recv_many(&mut round, KEYS_PER_PROBE_MAX).await > 0 {
        let keys: Vec<&str> = round.iter().map(|question| question.key.as_str()).collect();
        match store.keys_with_records(&keys).await {
            Ok(found) => answer_round(&mut round, &found),
            Err(error) => {
                tracing::warn!(%error, keys = round.len(), "key probe failed: the keys go to the database");
                metrics::counter!("stockd_key_probes_total", "result" => "error").increment(1);
                // Dropping the senders answers `None`.
                round.clear();
            }
        }
    }
}

fn answer_round(round: &mut Vec<Question>, found: &HashSet<String>) {
    metrics::counter!("stockd_key_probes_total", "result" => "read").increment(1);
    for question in round.drain(..) {
        let holds = found.contains(&question.key);
        // The asker may have gone away; nothing to tell then.
        let _ = question.answer.send(holds);
    }
}
