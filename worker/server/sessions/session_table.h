// The session table: the open sessions by key, the newest open epoch of each id, stage 0's index from the ids
// it gave the route (wire_down) to its own keys, the sessions each member holds, and when each was last used
// (--session-ttl).
//
// A part that owns its containers and its lock. The lock is a leaf: nothing of the worker's is called while it
// is held, and a `for_each` callback must take no lock (it may change the session it is given: the worker
// holds its own lock around such calls). The worker also holds its lock around the calls whose answer goes
// with its other state (docs/worker.md "Locks and their order"); a plain lookup (`find`, `latest_epoch`,
// `origin_key`) needs only this one. Every index changes with the entry it belongs to, under the one lock, so
// no reader sees a session without its epoch, its owner's count or its wire_down id, or those without it.
//
// What a session is (gRPC's messages, the engine's handles) is the worker's: the table is a template over it,
// as the step queue is over its steps, so it is tested alone (session_table_test.cpp: a cc_test under Bazel,
// `dgr-worker-unit-tests` under CMake) with nothing of gRPC or the engine.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dgr {

template <class S>
class SessionTable {
  public:
    using Key = std::pair<std::string, uint64_t>;    // (this worker's key for the session, epoch)
    using Ptr = std::shared_ptr<S>;
    using Clock = std::chrono::steady_clock;

    // OpenSession's questions about `key`, answered from one state of the table, in the order the worker asks
    // them: an epoch of the id that is open or newer refuses it (stale_epoch, `at` the epoch the id is at);
    // then its owner's sessions other than the id's own against `max_per_member` (0: no bound); then the open
    // sessions other than the id's own against `max_sessions`. Admitted: `older`, the id's open epochs, which
    // the worker closes before it opens this one.
    enum class Refused { none, stale_epoch, member_full, worker_full };
    struct Admit {
        Refused refused = Refused::none;
        uint64_t at = 0;                             // stale_epoch: the epoch the id is at
        int64_t member_held = 0;                     // member_full: the owner's sessions, the id's own left out
        std::vector<Key> older;                      // the id's open epochs, oldest first
    };

    SessionTable() = default;
    SessionTable(const SessionTable &) = delete;
    SessionTable & operator=(const SessionTable &) = delete;

    Admit admit(const Key & key, const std::string & owner, int64_t max_per_member, int64_t max_sessions) const {
        std::lock_guard<std::mutex> g(mu_);
        Admit a;
        auto le = latest_.find(key.first);
        if ((le != latest_.end() && key.second < le->second) || entries_.count(key)) {
            a.refused = Refused::stale_epoch;
            a.at = le != latest_.end() ? le->second : key.second;
            return a;
        }
        int64_t own = 0;                             // the id's epochs held by `owner` (its own, never counted)
        for (auto k = entries_.lower_bound(Key{key.first, 0}); k != entries_.end() && k->first.first == key.first; ++k) {
            a.older.push_back(k->first);
            own += k->second.owner == owner;
        }
        if (max_per_member > 0) {
            auto m = per_member_.find(owner);
            a.member_held = (m == per_member_.end() ? 0 : m->second) - own;
            if (a.member_held >= max_per_member) {
                a.refused = Refused::member_full;
                return a;
            }
        }
        if (entries_.size() - a.older.size() >= size_t(max_sessions)) a.refused = Refused::worker_full;
        return a;
    }

    // Opens `key` for `owner` (names.h: owner_of its key), last used `now`; the id is at its epoch from now on.
    // `wire`: stage 0's wire_down id for it under mutual TLS, by which the route's hops name it ("": none).
    // A session already under `key` is replaced (the worker admits a key once; two opens racing past `admit`
    // leave the later one).
    void insert(const Key & key, Ptr s, const std::string & owner, const std::string & wire, Clock::time_point now) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = entries_.find(key);
        if (it != entries_.end()) unindex(key, it->second);
        else it = entries_.emplace(key, Entry{}).first;
        it->second = Entry{std::move(s), owner, wire, now};
        ++per_member_[owner];
        latest_[key.first] = key.second;
        if (!wire.empty()) down_[wire] = key.first;
    }

    // Closes `key`: the session it held (null: none). Nothing of a session outlives it: its wire_down id, its
    // owner's count, and the id's latest epoch once no epoch of it is open (pruned whether `key` was open or not).
    Ptr erase(const Key & key) {
        std::lock_guard<std::mutex> g(mu_);
        Ptr out;
        auto it = entries_.find(key);
        if (it != entries_.end()) {
            out = std::move(it->second.s);
            unindex(key, it->second);
            entries_.erase(it);
        }
        auto k = entries_.lower_bound(Key{key.first, 0});
        if (k == entries_.end() || k->first.first != key.first) latest_.erase(key.first);
        return out;
    }

    Ptr find(const Key & key) const {
        std::lock_guard<std::mutex> g(mu_);
        auto it = entries_.find(key);
        return it == entries_.end() ? nullptr : it->second.s;
    }
    // the newest epoch of `id` opened while one of its epochs is open (nullopt: none is open)
    std::optional<uint64_t> latest_epoch(const std::string & id) const {
        std::lock_guard<std::mutex> g(mu_);
        auto it = latest_.find(id);
        return it == latest_.end() ? std::nullopt : std::optional<uint64_t>(it->second);
    }
    // stage 0: this worker's key (the id part) of the open session the route names by `wire` ("": none)
    std::string origin_key(const std::string & wire) const {
        std::lock_guard<std::mutex> g(mu_);
        auto it = down_.find(wire);
        return it == down_.end() ? std::string() : it->second;
    }

    // --session-ttl counts real progress: the session under `key` was used `now`, if it is still `s` (a step
    // that ran for a session closed meanwhile touches nothing, not even a later one under the same key)
    void touch(const Key & key, const Ptr & s, Clock::time_point now) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = entries_.find(key);
        if (it != entries_.end() && it->second.s == s) it->second.last_used = now;
    }
    // the sessions idle for more than `ttl_s` seconds at `now`, in key order (the worker reaps those without
    // steps queued)
    std::vector<std::pair<Key, Ptr>> expired(Clock::time_point now, double ttl_s) const {
        std::lock_guard<std::mutex> g(mu_);
        std::vector<std::pair<Key, Ptr>> out;
        for (auto & [k, e] : entries_) {
            if (std::chrono::duration<double>(now - e.last_used).count() > ttl_s) out.emplace_back(k, e.s);
        }
        return out;
    }
    // the longest any open session has been idle at `now`, in seconds (0: none is open)
    double longest_idle_s(Clock::time_point now) const {
        std::lock_guard<std::mutex> g(mu_);
        double idle = 0;
        for (auto & kv : entries_) idle = std::max(idle, std::chrono::duration<double>(now - kv.second.last_used).count());
        return idle;
    }

    size_t size() const {
        std::lock_guard<std::mutex> g(mu_);
        return entries_.size();
    }
    int64_t member_count(const std::string & owner) const {   // open sessions of `owner`
        std::lock_guard<std::mutex> g(mu_);
        auto m = per_member_.find(owner);
        return m == per_member_.end() ? 0 : m->second;
    }
    // Every open session in key order, under the table's lock: `fn` takes no lock and opens or closes nothing
    // here (the worker holds its own lock around it, which guards what `fn` reads or changes in a session)
    template <class F>                               // F: void(const Key &, const Ptr &)
    void for_each(F && fn) const {
        std::lock_guard<std::mutex> g(mu_);
        for (auto & kv : entries_) fn(kv.first, kv.second.s);
    }

  private:
    struct Entry {
        Ptr s;
        std::string owner;                           // whose count it is in
        std::string wire;                            // its entry in down_ ("": none)
        Clock::time_point last_used;
    };
    void unindex(const Key & key, const Entry & e) {   // mu_ held: `e` leaves the owner's count and down_
        auto m = per_member_.find(e.owner);
        if (m != per_member_.end() && --m->second <= 0) per_member_.erase(m);
        if (e.wire.empty()) return;
        auto d = down_.find(e.wire);
        if (d != down_.end() && d->second == key.first) down_.erase(d);
    }

    mutable std::mutex mu_;                          // guards everything below; a leaf
    std::map<Key, Entry> entries_;
    std::map<std::string, uint64_t> latest_;         // of ids with an open epoch (pruned with their last one)
    std::map<std::string, std::string> down_;        // stage 0, mTLS: wire_down id -> this worker's key
    std::map<std::string, int64_t> per_member_;      // open sessions per owner (an owner at 0 is erased)
};

}  // namespace dgr
