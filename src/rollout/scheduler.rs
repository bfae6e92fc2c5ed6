//! Admission for the engine: which waiting requests join the running batch, under the batch's
//! row limit and the KV-cache budget.
//!
//! The cache is a dense [rows, S] block whose S is at most the longest running row's final
//! length (prompt + max_tokens), so a batch fits while rows × that length stays within the budget
//! (in token slots). Requests are taken first come, first served: the first that does not fit
//! stops the admission (a large request at the head waits for room rather than being overtaken,
//! so none starves). A request of n samples takes n rows; one with `max_tokens` 0 takes none (it
//! is answered at once), though its length still counts. A request that could not fit even alone
//! is refused when it arrives ([`Scheduler::check_fits`]), so it never blocks the queue for good.

use crate::{Error, Result};

/// A waiting request as admission sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// Rows it would take (its samples).
    pub rows: usize,
    /// Prompt + max_tokens: the cache length each of its rows may reach.
    pub final_len: usize,
    /// Whether it decodes at all (`max_tokens` > 0); one that does not takes no rows.
    pub decodes: bool,
}

/// The engine's limits: rows in a batch, and KV-cache slots (rows × positions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduler {
    pub max_batch: usize,
    pub budget: usize,
}

impl Scheduler {
    /// Limits of `max_batch` rows and `budget` slots, both positive.
    pub fn new(max_batch: usize, budget: usize) -> Result<Self> {
        if max_batch == 0 {
            return Err(Error::input("engine max_batch must be positive"));
        }
        if budget == 0 {
            return Err(Error::input("engine kv_cache_tokens must be positive"));
        }
        Ok(Scheduler { max_batch, budget })
    }

    /// How many requests from the front of `waiting` join a batch of `rows` running rows whose
    /// longest final length is `longest`.
    pub fn admissible(&self, mut rows: usize, mut longest: usize, waiting: impl IntoIterator<Item = Demand>) -> usize {
        let mut count = 0;
        for d in waiting {
            if rows + d.rows > self.max_batch || (rows + d.rows) * longest.max(d.final_len) > self.budget {
                break;
            }
            longest = longest.max(d.final_len);
            if d.decodes {
                rows += d.rows;
            }
            count += 1;
        }
        count
    }

    /// Refuses a request that could not fit even alone: more samples than `max_batch`, or more
    /// slots than the budget (`bytes_per_slot` for the message).
    pub fn check_fits(
        &self,
        samples: usize,
        prompt_len: usize,
        max_tokens: usize,
        bytes_per_slot: usize,
    ) -> Result<()> {
        if samples > self.max_batch {
            return Err(Error::input(format!(
                "num_samples {samples} exceeds the engine's max_batch {}",
                self.max_batch
            )));
        }
        let need = samples * (prompt_len + max_tokens);
        if need > self.budget {
            return Err(Error::input(format!(
                "the request needs {need} KV-cache slots ({samples} samples × (prompt length {prompt_len} + max_tokens \
                 {max_tokens}), {} bytes) but the engine's budget is {} slots ({} bytes): it can never fit",
                need * bytes_per_slot,
                self.budget,
                self.budget * bytes_per_slot
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(rows: usize, final_len: usize) -> Demand {
        Demand { rows, final_len, decodes: true }
    }

    #[test]
    fn first_come_first_served_the_first_that_does_not_fit_stops_admission() {
        let s = Scheduler::new(8, 100).unwrap();
        // 2 × 10, then 4 × 20 would make 6 rows × 20 = 120 > 100: it waits, and so does the small
        // one behind it.
        assert_eq!(s.admissible(0, 0, [demand(2, 10), demand(4, 20), demand(1, 5)]), 1);
        // Alone, the second fits (4 × 20 = 80).
        assert_eq!(s.admissible(0, 0, [demand(4, 20), demand(1, 5)]), 2);
        // Running rows count: 3 rows of length 20 running, one more row of 10 fits (4 × 20).
        assert_eq!(s.admissible(3, 20, [demand(1, 10), demand(1, 10)]), 2);
        assert_eq!(s.admissible(0, 0, []), 0);
    }

    #[test]
    fn budget_and_batch_edges() {
        let s = Scheduler::new(4, 60).unwrap();
        assert_eq!(s.admissible(0, 0, [demand(3, 20)]), 1, "3 × 20 = 60: exactly the budget fits");
        assert_eq!(s.admissible(0, 0, [demand(3, 21)]), 0, "3 × 21 = 63: one slot over");
        assert_eq!(s.admissible(0, 0, [demand(4, 15)]), 1, "4 rows: exactly max_batch");
        assert_eq!(s.admissible(0, 0, [demand(5, 1)]), 0, "5 rows: over max_batch");
        assert_eq!(s.admissible(3, 10, [demand(1, 15), demand(1, 1)]), 1, "4 × 15 = 60, then a 5th row");
        // A longer newcomer widens every running row's slot count.
        assert_eq!(s.admissible(2, 10, [demand(1, 21)]), 0, "3 × 21 = 63");
    }

    #[test]
    fn max_tokens_zero_takes_no_rows_but_its_length_counts() {
        let s = Scheduler::new(2, 100).unwrap();
        let answer_only = Demand { rows: 2, final_len: 10, decodes: false };
        // Two running rows fill the batch, yet a request answered at once still needs room for
        // its rows in the check (as a decoding one would) — so it waits like any other.
        assert_eq!(s.admissible(2, 10, [answer_only]), 0);
        // With room, it is taken and takes no rows: the next request of 2 rows still fits.
        assert_eq!(s.admissible(0, 10, [answer_only, demand(2, 10)]), 2);
    }

    #[test]
    fn requests_that_can_never_fit_are_refused_naming_the_limit() {
        let s = Scheduler::new(4, 60).unwrap();
        assert!(s.check_fits(4, 10, 5, 8).is_ok());
        let e = s.check_fits(5, 1, 1, 8).unwrap_err().to_string();
        assert!(e.contains("num_samples 5 exceeds the engine's max_batch 4"), "{e}");
        let e = s.check_fits(2, 20, 11, 8).unwrap_err().to_string();
        assert!(
            e.contains("needs 62 KV-cache slots") && e.contains("496 bytes") && e.contains("60 slots (480 bytes)"),
            "{e}"
        );
        assert!(Scheduler::new(0, 1).is_err() && Scheduler::new(1, 0).is_err());
    }
}
