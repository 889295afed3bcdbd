// A few slots that members take turns at (docs/security.md "Bounded work per request"): the grammar
// conversions a worker runs at once (GRAMMARS_AT_ONCE: one can take ~0.3 s and ~100 MiB). A freed slot goes
// to the member whose turn it is: the members waiting are served in rotation, each member's own callers in the
// order they came, so one member's many callers wait behind each other and never in front of another member's.
// A part with its own (leaf) lock; a caller waits on it holding nothing else.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>

namespace dgr {

class FairTurns {
  public:
    explicit FairTurns(int slots) : free_(slots) {}
    FairTurns(const FairTurns &) = delete;
    FairTurns & operator=(const FairTurns &) = delete;

    // One slot, held until it is destroyed (moved from: nothing).
    class Turn {
      public:
        Turn(Turn && o) noexcept : turns_(o.turns_) { o.turns_ = nullptr; }
        Turn & operator=(Turn &&) = delete;
        ~Turn() {
            if (turns_) turns_->give_back();
        }

      private:
        friend class FairTurns;
        explicit Turn(FairTurns * t) : turns_(t) {}
        FairTurns * turns_;
    };

    // Wait for a slot for `member` ("" is a member too: plaintext's one tenant).
    Turn take(const std::string & member);
    // Callers waiting now, and slots held now.
    size_t waiting() const;
    int64_t held() const;

  private:
    struct Waiter {
        bool granted = false;
    };
    void give_back();
    void grant_locked();                          // mu_ held

    mutable std::mutex mu_;
    std::condition_variable granted_;            // waits on mu_
    int64_t free_;                               // slots nobody holds (mu_)
    int64_t held_ = 0;                           // (mu_)
    std::map<std::string, std::deque<Waiter *>> waiting_;   // each member's callers, first come first (mu_)
    std::deque<std::string> rotation_;           // members with callers waiting, whose turn comes first (mu_)
};

}  // namespace dgr
